"""One call of the ``s3dcp`` command in-process, as the CLI's tests make it."""

from s3dcp import cli


def run_cli(capsys, *argv):
    """``cli.main(argv)`` -> (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err
