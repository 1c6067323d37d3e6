"""What the PyTorch optimizer adds to ``state_dict()`` (under ``"hvd_compress"``) and
reads back: the compressor's state, its spec (a checkpoint made with another
compression is refused), the step count, and local SGD's anchors.  Checkpoints of
0.1 (one compressor, no per-tensor policy) still load."""

from __future__ import annotations

__all__ = ["ours", "load_ours"]


def ours(comp, session, local) -> dict:
    """The optimizer's part of its ``state_dict()``."""
    out = {"compressor": comp.state_dict(), "spec": comp.describe(),
           "optimizer_steps": session.steps}
    if local is not None:
        out.update(local.state_dict())
    return out


def load_ours(saved: dict, comp, session, local) -> None:
    """Load :func:`ours`' dict ``saved`` into ``comp``, the session's step count (the
    ranks agree on it again before a delayed start) and local SGD."""
    single = getattr(comp, "policy", None) and comp.policy.single
    if single is not None and saved["spec"] == str(single):
        # a checkpoint of 0.1 (one compressor, no policy): its state is that spec's
        comp.child(single).load_state_dict(saved["compressor"])
    elif saved["spec"] != comp.describe():
        raise ValueError(f"checkpoint was made with compression {saved['spec']!r}, "
                         f"this optimizer uses {comp.describe()!r}")
    else:
        comp.load_state_dict(saved["compressor"])
    session.set_steps(saved.get("optimizer_steps", 0), sure=False)
    if local is not None:
        local.load_state_dict(saved)
