"""Outputs where teams keep them: `output.uri` (S3) receives each complete checkpoint and
`final/` once written locally, `output.hub` receives `final/` (and with `every`, the
checkpoints); a job whose output directory holds no complete checkpoint resumes from the
bucket's newest (`restore_checkpoint`, run by the download step before the trainer starts).

Layout under `output.uri`: `checkpoints/step-N/...` (its `COMPLETE` uploaded last, so a
checkpoint in the bucket counts only once whole, as on the volume), `metrics.jsonl`,
`final/...`. Simplification: the bucket keeps every checkpoint uploaded
(`output.keepCheckpoints` prunes the volume only)."""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from rlhf_contract.api.uris import parse_remote
from rlhf_contract.outputs import (CHECKPOINTS, FINAL, MARKER, METRICS_FILE, checkpoint_step, complete_checkpoints,
                                   damage)

from . import StorageError, credentials_source, s3
from .files import unique_name

log = logging.getLogger(__name__)


def _split(uri: str) -> tuple[str, str]:
    remote = parse_remote(uri)
    return remote.name, remote.ref


def _key(prefix: str, *parts: str) -> str:
    return "/".join(p for p in (prefix, *parts) if p)


def restore_checkpoint(uri: str, output_dir: str) -> str:
    """Copy the newest complete checkpoint under `uri` (and its metrics.jsonl) into
    `output_dir` when that holds no usable one; also proves the key may write there.
    Every key is kept inside the checkpoint directory (files.confined: a key with `..`
    fails the step naming it, nothing is written). Returns what was done."""
    bucket, prefix = _split(uri)
    out = Path(output_dir)
    where = f"spec.output.uri: {uri}"
    try:
        client = s3.client(bucket)
        s3.check_writable(client, bucket, _key(prefix, ".rlhf-write-check"))
        if any(damage(p) is None for p in complete_checkpoints(out)):
            return f"{where}: writable; {out} already holds a complete checkpoint"
        root = _key(prefix, CHECKPOINTS)
        sizes: dict[str, int] = {}
        objects = s3.list_objects(client, bucket, root, sizes)
        steps = sorted({int(m.group(1)) for k in objects
                        if (m := re.fullmatch(re.escape(root) + r"/step-(\d+)/" + MARKER, k))})
        if not steps:
            return f"{where}: writable; no complete checkpoint there, the job starts from step 0"
        name = f"step-{steps[-1]}"
        ckpt_prefix = _key(prefix, CHECKPOINTS, name)
        keys = {k: etag for k, etag in objects.items() if k.startswith(ckpt_prefix + "/")}
        (out / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
        staging = out / CHECKPOINTS / unique_name(f".restore-{name}")
        shutil.rmtree(out / CHECKPOINTS / name, ignore_errors=True)  # not usable (above): a partial one
        try:
            s3.download(client, bucket, keys, ckpt_prefix, staging, where, sizes)
            os.replace(staging, out / CHECKPOINTS / name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        metrics = _key(prefix, METRICS_FILE)
        if not (out / METRICS_FILE).exists() and s3.list_objects(client, bucket, metrics):
            s3.retried(lambda: client.fget_object(bucket, metrics, str(out / METRICS_FILE)))
        return f"{where}: restored {name} into {out / CHECKPOINTS / name}"
    except s3.errors() as err:
        raise s3.error(err, where, bucket) from None


class Publisher:
    """Rank 0's uploads after each checkpoint and after the final export."""

    def __init__(self, uri: str | None, hub: Any | None, output_dir: Path):
        self.uri, self.hub, self.output_dir = uri, hub, output_dir

    def checkpoint(self, path: Path) -> None:
        step = checkpoint_step(path)
        if self.uri:
            bucket, prefix = _split(self.uri)
            client = s3.client(bucket)
            sent = s3.upload_dir(client, path, bucket, _key(prefix, CHECKPOINTS, path.name), last=MARKER)
            self.metrics(client)
            log.info("uploaded %s to %s (%d bytes)", path.name, self.uri, sent)
        if self.hub is not None and self.hub.every and step % self.hub.every == 0:
            self._push(path, f"{CHECKPOINTS}/{path.name}", f"checkpoint {path.name}")

    def metrics(self, client: Any = None) -> None:
        """metrics.jsonl as it is now, to `output.uri` (a resume from the bucket keeps its rows)."""
        if self.uri and (self.output_dir / METRICS_FILE).exists():
            bucket, prefix = _split(self.uri)
            client = client or s3.client(bucket)
            local = str(self.output_dir / METRICS_FILE)
            s3.retried(lambda: client.fput_object(bucket, _key(prefix, METRICS_FILE), local))

    def final(self, final_dir: Path) -> None:
        if self.uri:
            bucket, prefix = _split(self.uri)
            sent = s3.upload_dir(s3.client(bucket), final_dir, bucket, _key(prefix, FINAL))
            log.info("uploaded %s to %s (%d bytes)", final_dir, self.uri, sent)
        if self.hub is not None:
            self._push(final_dir, None, "final model")

    def _push(self, folder: Path, path_in_repo: str | None, what: str) -> None:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError

        api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
        try:
            api.create_repo(self.hub.repo, private=self.hub.private, exist_ok=True)
            api.upload_folder(repo_id=self.hub.repo, folder_path=folder, path_in_repo=path_in_repo,
                              commit_message=f"rlhf-operator: {what}")
        except HfHubHTTPError as err:
            status = err.response.status_code if err.response is not None else None
            raise StorageError(f"spec.output.hub.repo: pushing {what} to {self.hub.repo!r} failed ({status}) with "
                               f"{credentials_source('HF_TOKEN')}", permanent=status in (401, 403)) from None
        log.info("pushed %s to the Hub repository %s", what, self.hub.repo)
