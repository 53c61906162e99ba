"""S3 as teams run it (issue 52), against versitygw: the bucket's region discovered (versitygw
refuses a request signed for another region, as AWS does) and a wrong one refused naming both;
credentials through the AWS provider chain with minio's own providers: web identity (IRSA) from
a served STS endpoint, container credentials (EKS Pod Identity) from a served credentials
endpoint, each handing out keys versitygw accepts; `AWS_ENDPOINT_URL_S3` over
`AWS_ENDPOINT_URL`; TLS verified against `AWS_CA_BUNDLE`; SlowDown (503) and a Hub 429
retried inside the step (Retry-After respected); a missing bucket or object is exit 2 naming
it; objects and ranged parts downloaded in parallel, byte for byte.

Limits: the STS and credentials endpoints are small servers here speaking the documented
wire formats (AssumeRoleWithWebIdentity's XML, the container-credentials JSON), not AWS's;
they hand out versitygw's own keys with an empty session token (versitygw has no STS and
refuses a session token it did not issue: InvalidToken), so the token's header is not tested;
the instance profile (IMDS) is minio's own provider, not exercised."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from rlhf_contract.sources import Fetch
from rlhf_trainer.storage import s3
from storage_servers import S3_ACCESS_KEY, S3_SECRET_KEY, S3Server, Served, forward
from test_storage_hostile import HostileS3
from test_storage_servers import files_of, run_step

REGION = "eu-west-3"


@pytest.fixture(scope="module")
def regional(tmp_path_factory, tiny_model_dir):
    """versitygw in eu-west-3 with a model and a data file."""
    server = S3Server(tmp_path_factory.mktemp("s3-region"), region=REGION)
    server.put_dir("team-paris", "models/tiny", tiny_model_dir)
    yield server
    server.kill()


def _fetch(tmp_path: Path, uri: str = "s3://team-paris/models/tiny", field: str = "spec.model.path") -> Fetch:
    return Fetch(field, uri, "model", str(tmp_path / "out/sources/s3" / uri[len("s3://"):]))


def test_the_buckets_region_is_discovered_and_a_wrong_one_is_exit_2(regional, tiny_model_dir, tmp_path):
    fetch = _fetch(tmp_path)
    proc = run_step([fetch], regional.env(AWS_REGION=""))  # no region named: the bucket's own is found
    assert proc.returncode == 0, proc.stderr
    assert files_of(Path(fetch.local)) == files_of(tiny_model_dir)
    wrong = _fetch(tmp_path / "wrong")
    proc = run_step([wrong], regional.env(AWS_REGION="us-east-1"))
    assert proc.returncode == 2, proc.stderr  # permanent: no restart fixes a region
    assert ("spec.model.path" in proc.stderr and "is in region 'eu-west-3', not AWS_REGION/AWS_DEFAULT_REGION "
            "'us-east-1'" in proc.stderr and "set AWS_REGION to 'eu-west-3'" in proc.stderr), proc.stderr
    assert not Path(wrong.marker()).exists()
    missing = _fetch(tmp_path / "missing", "s3://no-such-bucket/models/tiny")
    proc = run_step([missing], regional.env(AWS_REGION=""))
    assert proc.returncode == 2 and "the bucket 'no-such-bucket' does not exist" in proc.stderr, proc.stderr


def _sts_answer(issued: dict):
    def answer(handler, body):
        query = parse_qs(urlsplit(handler.path).query)
        issued.setdefault("queries", []).append(query)
        if query.get("Action") != ["AssumeRoleWithWebIdentity"] or query.get("WebIdentityToken") != ["the-pod-jwt"]:
            refusal = b"<ErrorResponse><Error><Code>AccessDenied</Code></Error></ErrorResponse>"
            return 403, {"Content-Type": "text/xml"}, refusal
        expires = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)).strftime(
            "%Y-%m-%dT%H:%M:%SZ")
        xml = (f'<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
               f"<AssumeRoleWithWebIdentityResult><Credentials><AccessKeyId>{issued['access']}</AccessKeyId>"
               f"<SecretAccessKey>{issued['secret']}</SecretAccessKey><SessionToken></SessionToken>"
               f"<Expiration>{expires}</Expiration></Credentials></AssumeRoleWithWebIdentityResult>"
               f"</AssumeRoleWithWebIdentityResponse>")
        return 200, {"Content-Type": "text/xml"}, xml.encode()
    return answer


def test_web_identity_irsa_through_the_sdks_provider(regional, tiny_model_dir, tmp_path):
    """IRSA's variables only (no keys): minio's IamAwsProvider trades the projected token for
    keys at AWS_ENDPOINT_URL_STS; those keys sign the requests."""
    issued = {"access": S3_ACCESS_KEY, "secret": S3_SECRET_KEY}
    sts = Served(_sts_answer(issued))
    try:
        token = tmp_path / "token"
        token.write_text("the-pod-jwt")
        env = regional.env(AWS_ACCESS_KEY_ID="", AWS_SECRET_ACCESS_KEY="", AWS_ROLE_ARN="arn:aws:iam::1:role/reader",
                           AWS_WEB_IDENTITY_TOKEN_FILE=str(token), AWS_ENDPOINT_URL_STS=sts.url)
        fetch = _fetch(tmp_path)
        proc = run_step([fetch], env)
        assert proc.returncode == 0, proc.stderr
        assert files_of(Path(fetch.local)) == files_of(tiny_model_dir)
        query = issued["queries"][0]
        assert query["RoleArn"] == ["arn:aws:iam::1:role/reader"] and query["Action"] == ["AssumeRoleWithWebIdentity"]
        token.write_text("a-token-sts-refuses")  # a refused identity is a config error naming the role
        proc = run_step([_fetch(tmp_path / "refused")], env)
        assert proc.returncode == 2 and "no credentials from web identity (AWS_ROLE_ARN 'arn:aws:iam::1:role/reader')" \
            in proc.stderr, proc.stderr
    finally:
        sts.close()


def test_container_credentials_eks_pod_identity(regional, tiny_model_dir, tmp_path):
    """EKS Pod Identity's variables: the credentials endpoint is asked with the token file's
    content as Authorization, and its keys sign the requests."""
    expires = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)).strftime(
        "%Y-%m-%dT%H:%M:%SZ")

    def answer(handler, body):
        if handler.headers.get("Authorization") != "pod-identity-token":
            return 401, {}, b"{}"
        return 200, {"Content-Type": "application/json"}, json.dumps(
            {"AccessKeyId": S3_ACCESS_KEY, "SecretAccessKey": S3_SECRET_KEY, "Token": "",
             "Expiration": expires}).encode()

    agent = Served(answer)
    try:
        token = tmp_path / "eks-pod-identity-token"
        token.write_text("pod-identity-token")
        env = regional.env(AWS_ACCESS_KEY_ID="", AWS_SECRET_ACCESS_KEY="",
                           AWS_CONTAINER_CREDENTIALS_FULL_URI=f"{agent.url}/v1/credentials",
                           AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE=str(token))
        fetch = _fetch(tmp_path)
        proc = run_step([fetch], env)
        assert proc.returncode == 0, proc.stderr
        assert files_of(Path(fetch.local)) == files_of(tiny_model_dir)
        assert agent.requests and all(r[1] == "/v1/credentials" for r in agent.requests)
    finally:
        agent.close()


def test_a_profile_of_the_shared_credentials_file(regional, tiny_model_dir, tmp_path):
    """AWS_PROFILE (local mode, a mounted file): its keys sign; a profile that is not there
    is exit 2 naming it."""
    shared = tmp_path / "credentials"
    shared.write_text(f"[default]\naws_access_key_id = nobody\naws_secret_access_key = nothing\n\n"
                      f"[team]\naws_access_key_id = {S3_ACCESS_KEY}\naws_secret_access_key = {S3_SECRET_KEY}\n")
    env = regional.env(AWS_ACCESS_KEY_ID="", AWS_SECRET_ACCESS_KEY="", AWS_SHARED_CREDENTIALS_FILE=str(shared))
    fetch = _fetch(tmp_path)
    proc = run_step([fetch], {**env, "AWS_PROFILE": "team"})
    assert proc.returncode == 0, proc.stderr
    assert files_of(Path(fetch.local)) == files_of(tiny_model_dir)
    proc = run_step([_fetch(tmp_path / "other")], {**env, "AWS_PROFILE": "missing"})
    assert proc.returncode == 2 and f"no credentials from profile 'missing' of {shared}" in proc.stderr, proc.stderr


def _self_signed(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it: (ca.pem, cert.pem, key.pem)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rlhf test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(2).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = directory / "ca.pem", directory / "cert.pem", directory / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def test_tls_verified_against_aws_ca_bundle(tmp_path, tiny_model_dir):
    ca, cert, key = _self_signed(tmp_path)
    server = S3Server(tmp_path / "server", tls=(cert, key))
    try:
        server.put_dir("private-ca", "models/tiny", tiny_model_dir)
        fetch = Fetch("spec.model.path", "s3://private-ca/models/tiny", "model",
                      str(tmp_path / "a/sources/s3/private-ca/models/tiny"))
        proc = run_step([fetch], server.env(AWS_CA_BUNDLE=str(ca)))
        assert proc.returncode == 0, proc.stderr
        assert files_of(Path(fetch.local)) == files_of(tiny_model_dir)
        unverified = Fetch("spec.model.path", "s3://private-ca/models/tiny", "model",
                           str(tmp_path / "b/sources/s3/private-ca/models/tiny"))
        proc = run_step([unverified], server.env())  # certifi's bundle does not know this CA
        assert proc.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in proc.stderr, proc.stderr
    finally:
        server.kill()


def test_slowdown_retried_inside_the_step_and_the_s3_endpoint_variable_wins(regional, tmp_path):
    """Every object's first GET answers 503 SlowDown with Retry-After: 1 (a 500 for one of
    them): the step still ends with exit 0 in one run, having waited as asked; the endpoint is
    AWS_ENDPOINT_URL_S3's (AWS_ENDPOINT_URL points nowhere)."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        (data / f"part-{i}.jsonl").write_bytes(os.urandom(3000 + i))
    regional.put_dir("team-paris", "slow", data)
    refused: dict[str, int] = {}

    def answer(handler, body):
        path = urlsplit(handler.path).path
        if handler.command == "GET" and "/slow/" in path and path not in refused:
            refused[path] = 500 if path.endswith("part-3.jsonl") else 503
            code = "InternalError" if refused[path] == 500 else "SlowDown"
            xml = f"<Error><Code>{code}</Code><Message>Please reduce your request rate.</Message></Error>"
            return refused[path], {"Content-Type": "application/xml", "Retry-After": "1"}, xml.encode()
        return forward(regional.port, handler, body)

    proxy = Served(answer)
    try:
        fetch = _fetch(tmp_path, "s3://team-paris/slow", "spec.data.path")
        start = time.monotonic()
        proc = run_step([fetch], regional.env(AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_ENDPOINT_URL_S3=proxy.url))
        took = time.monotonic() - start
        assert proc.returncode == 0, proc.stderr
        assert files_of(Path(fetch.local)) == files_of(data)
        assert sorted(refused.values()) == [500, 503, 503, 503] and took >= 1.0  # waited the Retry-After
        gets = [r for r in proxy.requests if r[0] == "GET" and "/slow/" in r[1]]
        assert len(gets) == 8  # each object: the refused GET and one more
    finally:
        proxy.close()


def test_a_listed_object_that_is_gone_is_exit_2_naming_it(regional, tmp_path):
    proxy = HostileS3(regional, {"team-paris": ["models/tiny/extra/vanished.bin"]})
    try:
        fetch = _fetch(tmp_path)
        proc = run_step([fetch], regional.env(AWS_ENDPOINT_URL=proxy.endpoint))
        assert proc.returncode == 2, proc.stderr
        assert "the object 'models/tiny/extra/vanished.bin' is not in bucket 'team-paris'" in proc.stderr, proc.stderr
    finally:
        proxy.close()


def test_objects_and_ranged_parts_in_parallel_byte_for_byte(regional, tmp_path, monkeypatch):
    """A 5 MiB object in 1 MiB ranged parts and 12 small objects: every byte in place, several
    requests in flight at once, each part a Range request."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "big.bin").write_bytes(os.urandom(5 << 20) + b"tail")
    for i in range(12):
        (data / f"small-{i}.txt").write_text(f"row {i}\n" * (i + 1))
    regional.put_dir("team-paris", "parallel", data)
    in_flight, peak, lock = [0], [0], threading.Lock()

    def answer(handler, body):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        try:
            time.sleep(0.05 if handler.command == "GET" else 0)
            return forward(regional.port, handler, body)
        finally:
            with lock:
                in_flight[0] -= 1

    proxy = Served(answer)
    try:
        for key, value in regional.env(AWS_ENDPOINT_URL=proxy.url).items():
            monkeypatch.setenv(key, value)
        client = s3.client("team-paris")
        sizes: dict[str, int] = {}
        objects = s3.list_objects(client, "team-paris", "parallel", sizes)
        s3.download(client, "team-paris", objects, "parallel", tmp_path / "copy", "test", sizes, part_bytes=1 << 20)
        assert files_of(tmp_path / "copy") == files_of(data)
        assert hashlib.sha256((tmp_path / "copy/big.bin").read_bytes()).digest() == hashlib.sha256(
            (data / "big.bin").read_bytes()).digest()
        ranges = [r[2].get("Range") for r in proxy.requests
                  if r[0] == "GET" and r[1].startswith("/team-paris/parallel/big")]
        assert sorted(ranges) == sorted(f"bytes={o}-{min(o + (1 << 20), (5 << 20) + 4) - 1}"
                                        for o in range(0, (5 << 20) + 4, 1 << 20))  # 6 parts, the last 4 bytes
        assert peak[0] >= 4  # objects and parts overlap
    finally:
        proxy.close()


def test_hub_429_retried_inside_the_step(hub_server, tiny_model_dir, tmp_path):
    """The Hub answers 429 (Retry-After: 1) to the first two API calls: the step waits and
    finishes in one run rather than failing the attempt."""
    commit = hub_server.add_repo("org/busy", tiny_model_dir)
    upstream = int(hub_server.endpoint.rsplit(":", 1)[1])
    limited = [0]

    def answer(handler, body):
        if handler.path.startswith("/api/") and limited[0] < 2:
            limited[0] += 1
            return 429, {"Retry-After": "1", "Content-Type": "application/json"}, b'{"error": "rate limited"}'
        return forward(upstream, handler, body)

    proxy = Served(answer)
    try:
        fetch = Fetch("spec.model.path", "hf://org/busy", "model", str(tmp_path / "sources/hf/models/org/busy/main"))
        start = time.monotonic()
        proc = run_step([fetch], {"HF_ENDPOINT": proxy.url})
        assert proc.returncode == 0, proc.stderr
        # a Retry-After of 1 s was waited (huggingface_hub's own backoff may take the other one sooner)
        assert limited[0] == 2 and time.monotonic() - start >= 1.0
        assert json.loads(Path(fetch.marker()).read_text())["revision"] == commit
        assert files_of(Path(fetch.local)) == {k: v for k, v in files_of(tiny_model_dir).items()
                                               if k != ".builtin"}  # not a model file: not downloaded
    finally:
        proxy.close()
