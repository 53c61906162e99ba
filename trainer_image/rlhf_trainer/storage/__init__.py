"""Models, data and outputs where teams keep them: the Hugging Face Hub (`hf://`) and
S3-compatible object storage (`s3://`).

`fetch.py`: the download step (`python -m rlhf_trainer.storage`: the init container of each
pod that needs it, and local mode before anything starts). `pins.py`: the revision each
source is pinned to for the job. `cache.py`: the download cache shared by jobs
(`spec.sourceCache`). `files.py`: names kept inside their directory, markers
written atomically and what they list. `s3.py`: the S3 client, prefix downloads and
uploads. `publish.py`: `output.uri` uploads, resume from the bucket, and `output.hub`
pushes. `model_card.py`: `final/README.md`.

Credentials are read from the environment (rlhf_contract.sources.CREDENTIAL_ENV) by the
clients themselves; no message or log line contains them."""

from __future__ import annotations

import os

from rlhf_contract.sources import ENV_STORAGE_SECRET


class StorageError(RuntimeError):
    """A download or upload failed; `permanent` when only a change to the spec or the
    Secret can fix it (exit 2), else it may work on the next attempt (exit 1)."""

    def __init__(self, message: str, *, permanent: bool):
        super().__init__(message)
        self.permanent = permanent


def credentials_source(*names: str) -> str:
    """Where the credentials `names` come from, for an error message."""
    secret = os.environ.get(ENV_STORAGE_SECRET)
    given = [n for n in names if os.environ.get(n)]
    what = ", ".join(names) + (f" (set: {', '.join(given)})" if given else " (none set)")
    if secret:
        return f"{what} from the Secret {secret!r} (spec.storageSecret)"
    return f"{what} from this environment (on a cluster: spec.storageSecret)"
