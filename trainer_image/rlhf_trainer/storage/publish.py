"""Outputs where teams keep them: `output.uri` (S3) receives each complete checkpoint and
`final/` once written locally, `output.hub` receives `final/` (and with `every`, a loadable
model of every N-th step: `hub/step-N/`, one commit tagged `step-N`); a job whose output
directory holds no complete checkpoint resumes from the bucket's newest
(`restore_checkpoint`, run by the download step before the trainer starts).

Layout under `output.uri`: `checkpoints/step-N/...` (its `COMPLETE` uploaded last, so a
checkpoint in the bucket counts only once whole, as on the volume), `metrics.jsonl`,
`final/...`. Uploads run on one worker thread (`Publisher`). Simplifications: the bucket
keeps every checkpoint uploaded (`output.keepCheckpoints` prunes the local copies only);
the files of one checkpoint go up one at a time (minio's multipart for a large one); a Hub
tag that exists (a step trained again after a restart) is left where it was."""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
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
    """Rank 0's uploads, off the training's critical path: each complete checkpoint (and,
    with `output.hub.every`, a loadable model of that step) goes up on one worker thread
    while the next steps train. At most one upload is in flight: a new one (and the next
    save, `wait`) first waits for the previous, so the disk and memory they hold stay
    bounded; an upload that failed raises its StorageError at that wait (the job fails
    naming it, nothing is lost silently); `final` waits for the last one before the job
    can report success."""

    def __init__(self, uri: str | None, hub: Any | None, output_dir: Path):
        self.uri, self.hub, self.output_dir = uri, hub, output_dir
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="rlhf-upload")
        self._pending: Future | None = None

    @property
    def busy(self) -> bool:
        """An upload is in flight."""
        return self._pending is not None and not self._pending.done()

    def checkpoint(self, path: Path, model: Path | None = None) -> None:
        """Start uploading the complete checkpoint `path` to `output.uri` (its COMPLETE last),
        with metrics.jsonl as it is now, and push `model` (a Hugging Face directory of this
        step, `output.hub.every`) to the Hub; returns once it is under way."""
        self.wait()
        metrics = self._metrics_now()
        self._pending = self._worker.submit(self._upload_checkpoint, path, metrics, model)

    def metrics(self) -> None:
        """metrics.jsonl as it is now, to `output.uri` (a resume from the bucket keeps its rows)."""
        self.wait()
        if self.uri and (metrics := self._metrics_now()) is not None:
            self._pending = self._worker.submit(self._guarded, "metrics.jsonl", self._put_metrics, metrics)

    def wait(self) -> float:
        """Until the upload in flight is over; raises its failure (a StorageError naming it).
        Returns the seconds waited."""
        pending, self._pending = self._pending, None
        start = time.monotonic()
        if pending is not None:
            pending.result()
        return time.monotonic() - start

    def final(self, final_dir: Path) -> None:
        """`final/` to `output.uri` and the Hub, after the last checkpoint's upload (in this thread)."""
        self.wait()
        if self.uri:
            self._guarded("final/", lambda: self._put_dir(final_dir, FINAL))
        if self.hub is not None:
            self._push(final_dir, "final model")

    def close(self) -> None:
        """Let an upload in flight finish (a run that failed still leaves its newest checkpoint
        in the bucket), logging rather than raising its failure."""
        try:
            self.wait()
        except Exception as err:
            log.error("%s", err)
        self._worker.shutdown(wait=True)

    # ---- on the worker ------------------------------------------------------------------

    def _metrics_now(self) -> bytes | None:
        path = self.output_dir / METRICS_FILE
        return path.read_bytes() if path.exists() else None  # a copy: the loop appends while it goes up

    def _upload_checkpoint(self, path: Path, metrics: bytes | None, model: Path | None) -> None:
        if self.uri:
            self._guarded(f"checkpoint {path.name}", lambda: self._put_dir(path, f"{CHECKPOINTS}/{path.name}",
                                                                           last=MARKER))
            if metrics is not None:
                self._guarded("metrics.jsonl", self._put_metrics, metrics)
        if model is not None and self.hub is not None:
            step = checkpoint_step(path)
            self._push(model, f"step {step}", tag=f"step-{step}")
            shutil.rmtree(model, ignore_errors=True)

    def _guarded(self, what: str, fn: Any, *args: Any) -> None:
        bucket, _ = _split(self.uri)
        try:
            fn(*args)
        except s3.errors() as err:
            raise s3.error(err, f"spec.output.uri: uploading {what} to {self.uri}", bucket) from None

    def _put_dir(self, directory: Path, name: str, last: str | None = None) -> None:
        bucket, prefix = _split(self.uri)
        sent = s3.upload_dir(s3.client(bucket), directory, bucket, _key(prefix, name), last=last)
        log.info("uploaded %s to %s (%d bytes)", directory, self.uri, sent)

    def _put_metrics(self, data: bytes) -> None:
        bucket, prefix = _split(self.uri)
        client = s3.client(bucket)
        s3.retried(lambda: client.put_object(bucket, _key(prefix, METRICS_FILE), io.BytesIO(data), len(data)))

    def _push(self, folder: Path, what: str, *, tag: str | None = None) -> None:
        """`folder` as a commit of the repository's root (a model `from_pretrained` loads at
        that revision), tagged `tag` when given."""
        from huggingface_hub import CommitOperationAdd, HfApi
        from huggingface_hub.errors import HfHubHTTPError

        api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
        files = sorted(f for f in folder.rglob("*") if f.is_file())
        try:
            api.create_repo(self.hub.repo, private=self.hub.private, exist_ok=True)
            # one commit: a revision is a whole model (upload_folder may split a large folder into several)
            commit = api.create_commit(self.hub.repo, commit_message=f"rlhf-operator: {what}", operations=[
                CommitOperationAdd(path_in_repo=f.relative_to(folder).as_posix(), path_or_fileobj=str(f)) for f in files])
            if tag is not None:
                api.create_tag(self.hub.repo, tag=tag, revision=commit.oid, exist_ok=True)
        except HfHubHTTPError as err:
            status = err.response.status_code if err.response is not None else None
            raise StorageError(f"spec.output.hub.repo: pushing {what} to {self.hub.repo!r} failed ({status}) with "
                               f"{credentials_source('HF_TOKEN')}", permanent=status in (401, 403)) from None
        except ValueError as err:  # the Hub refused the model card's metadata
            raise StorageError(f"spec.output.hub.repo: pushing {what} to {self.hub.repo!r}: {err}",
                               permanent=True) from None
        log.info("pushed %s to the Hub repository %s (revision %s%s)", what, self.hub.repo, commit.oid,
                 f", tag {tag}" if tag else "")
