"""What a push to the Hugging Face Hub needs, checked before anything is computed or uploaded: a token,
and, for a private push, a repository that is private or does not exist yet.

The hub ignores ``private=True`` for a repository that already exists (``create_repo(exist_ok=True)``
keeps its visibility), so a private push into an existing public repository is refused here rather than
published; it never changes an existing repository's visibility.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_push_target", "hub_token"]

_LOGIN = "log in with `hf auth login` (or `huggingface-cli login`) or set the HF_TOKEN environment variable"


def hub_token(token: str | None = None, argument: str = "push_to_hub") -> str:
    """`token`, else the one huggingface_hub finds (HF_TOKEN, the login's token file); a ValueError
    naming `argument` when there is none: a push without a token would fail after all the work."""
    from huggingface_hub import get_token

    found = token or get_token()
    if not found:
        raise ValueError(f"`{argument}`: no Hugging Face token found, so nothing can be pushed: {_LOGIN}.")
    return found


def check_push_target(repo_id: str, *, private: bool | None, token: str | None = None,
                      argument: str = "push_to_hub", api: Any = None) -> str:
    """Check, before any work, that `repo_id` can be pushed to as asked; returns the token.

    A token must exist (`hub_token`). With `private`, the repository must be private or not exist yet
    (it is then created private): an existing public one is refused (ValueError naming `argument`),
    since the hub would publish the files there whatever `private` says."""
    token = hub_token(token, argument)
    if not private:
        return token
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    api = api if api is not None else HfApi(token=token)
    try:
        info = api.repo_info(repo_id, repo_type="model")
    except RepositoryNotFoundError:
        return token  # created private by the push
    if not getattr(info, "private", False):
        raise ValueError(
            f"`{argument}`: {repo_id!r} exists and is public; a private push would publish the files there (the "
            "hub keeps an existing repository's visibility). Make it private first (its Settings page, or "
            f"`HfApi().update_repo_settings({repo_id!r}, private=True)`), push to a new repository, or push "
            "without private; nothing was pushed."
        )
    return token
