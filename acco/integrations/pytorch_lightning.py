""":class:`AccoStrategy` for ``pytorch_lightning.Trainer``: the same strategy as
:mod:`acco.integrations.lightning`, built on the ``pytorch_lightning`` namespace.

Lightning ships its Trainer twice, as ``lightning.pytorch`` (package ``lightning``) and as
``pytorch_lightning`` (package ``pytorch-lightning``), the second generated from the first's
sources by rewriting their imports. The two namespaces hold distinct classes, and a Trainer
refuses a strategy, callback or precision plugin from the other one (the fate of
lightning-hivemind's strategy under ``pytorch_lightning``, its issue #16). So this module is
:mod:`acco.integrations.lightning` with Lightning's own rewrite applied to its imports: one
implementation, a class per namespace::

    from pytorch_lightning import Trainer
    from acco.integrations.pytorch_lightning import AccoStrategy

    trainer = Trainer(accelerator="cpu", devices=2, strategy=AccoStrategy(mode="acco"), accumulate_grad_batches=2)
"""

from __future__ import annotations

from pathlib import Path

try:
    import lightning_fabric  # noqa: F401
    import pytorch_lightning  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised only without the package
    raise ImportError("acco.integrations.pytorch_lightning needs pytorch-lightning: pip install pytorch-lightning "
                      "(or use acco.integrations.lightning with the lightning package)") from error

__all__ = ["AccoStrategy", "LightningAccoOptimizer"]

# How Lightning builds pytorch_lightning from lightning's sources (its setup tools'
# import rewrite), restricted to the two subpackages the strategy imports.
_RENAMES = (("lightning.pytorch", "pytorch_lightning"), ("lightning.fabric", "lightning_fabric"))


def _rewritten_source() -> str:
    source = Path(__file__).with_name("lightning.py").read_text(encoding="utf-8")
    for old, new in _RENAMES:
        source = source.replace(old, new)
    return source


# Compiled under lightning.py's file name: lines are unchanged, so tracebacks and debuggers
# point at the real source. The classes are this module's (pickled by this name).
exec(compile(_rewritten_source(), str(Path(__file__).with_name("lightning.py")), "exec"), globals())
