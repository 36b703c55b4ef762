"""Reading the commands and snippets of the README and of the pages in ``docs/``, for the tests
that run them as written (tests/test_readme.py, tests/test_docs.py)."""

from __future__ import annotations

import os
import re
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(page: str = "README.md") -> str:
    """The text of ``page``, a path relative to the repository root."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def section(heading: str, page: str = "README.md") -> str:
    """The text of the section of ``page`` whose heading starts with ``heading``, up to the next
    heading of the same or a higher level (headings inside code blocks do not count)."""
    text = read(page)
    headings = [m for m in re.finditer(r"^(#+) (.*)$", text, flags=re.M) if not _in_fence(text, m.start())]
    found = [m for m in headings if m.group(2).startswith(heading)]
    assert len(found) == 1, f"{page} has {len(found)} sections {heading!r}"
    (match,) = found
    level = len(match.group(1))
    ends = [m.start() for m in headings if m.start() > match.start() and len(m.group(1)) <= level]
    return text[match.end():ends[0] if ends else len(text)]


def blocks(heading: str, lang: str, page: str = "README.md") -> list[str]:
    """The ``lang`` code blocks of that section, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", section(heading, page), flags=re.M | re.S)


def all_blocks(page: str) -> list[tuple[str, str]]:
    """Every fenced block of ``page`` as ``(lang, code)``."""
    return re.findall(r"^```(\w*)\n(.*?)^```", read(page), flags=re.M | re.S)


def _in_fence(text: str, pos: int) -> bool:
    return len(re.findall(r"^```", text[:pos], flags=re.M)) % 2 == 1


def fresh_bucket(s3_server) -> str:
    name = f"t-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(name)
    return name


def in_bucket(code: str, bucket: str) -> str:
    """``code`` with the page's ``s3://bucket`` (and ``s3dcp://bucket``) made ``<bucket>``."""
    changed, count = re.subn(r"(s3(?:dcp)?://)bucket(?=[/\s'\"]|$)", rf"\g<1>{bucket}", code, flags=re.M)
    assert count, code
    return changed


@pytest.fixture
def aws_env(monkeypatch, s3_server):
    """The environment ``eval "$(s3dcp server --print-env)"`` gives, for in-process snippets."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)


def tiny_lightning_model(samples: int, batch_size: int, lr: float):
    """A LightningModule the trainer snippets fit: a linear layer on ``samples`` fixed rows,
    logging ``train_loss`` (what their ModelCheckpoint monitors)."""
    import pytorch_lightning as pl
    import torch

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

        def train_dataloader(self):
            x = torch.randn(samples, 4, generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :2]), batch_size=batch_size)

    return Model()
