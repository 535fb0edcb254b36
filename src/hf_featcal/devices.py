"""The one check of a user-given compute device, shared by the calibrator and the CLI."""

from __future__ import annotations

import torch


def usable_device(device: str | torch.device, argument: str = "`device`") -> torch.device:
    """`device` as a `torch.device`, after checking that this machine can hold a tensor there.

    Raises a ValueError naming `argument` (e.g. "`device`", "--device") for a name torch does not know,
    for the meta device (it holds no values) and for a device that is not there (cuda without a GPU, a
    device index past the last one).
    """
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{argument}: {device!r} is not a torch device ({err})") from None
    if resolved.type == "meta":
        raise ValueError(f"{argument}: 'meta' holds no values; use e.g. 'cpu' or 'cuda'")
    try:
        torch.empty(1, device=resolved)
    except Exception as err:  # noqa: BLE001 - e.g. "cuda" without a GPU, a device index that is not there
        reason = " ".join(str(err).split())
        raise ValueError(
            f"{argument}: {str(resolved)!r} is not usable on this machine ({type(err).__name__}: {reason})"
        ) from None
    return resolved
