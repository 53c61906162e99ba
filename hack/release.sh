#!/usr/bin/env bash
# Publishes a release (`make release`): the Helm chart as an OCI artifact whose values pin the
# operator image by tag and digest, and the Python package (rlhfctl) as an sdist and a wheel.
#
#   REGISTRY=ghcr.io/rlhf-operator hack/release.sh
#   REGISTRY=127.0.0.1:5000/rlhf-operator PLAIN_HTTP=1 hack/release.sh
#
# Before it: the four images (operator, trainer, inference, colocated) pushed as
# $REGISTRY/<name>:<version> and their digests in the lock file the image build writes
# (`make images IMAGE_REGISTRY=$REGISTRY`: hack/images.py). The version is the project's one
# version: pyproject.toml, contract/rlhf_contract/images.py and the chart must agree.
#
# Environment:
#   REGISTRY     required: where the images are; the chart goes to oci://$REGISTRY/charts
#   PLAIN_HTTP   1: the registry speaks plain HTTP (a registry on loopback); default 0
#   IMAGES_LOCK  the image build's lock file (default dist/images.lock.json)
#   DIST         where the chart package, the sdist and the wheel go (default dist)
#   HELM         helm (default: helm on PATH); a registry that wants a login: `helm registry login` first
#   PYTHON       a Python with pyyaml (default .venv/bin/python, else python3)
#   UV           uv for `uv build` (default .venv/bin/uv, else uv on PATH; without uv: python -m build)
#
# The chart in the repository is never modified: it is copied to a temporary directory, whose
# values.yaml gets the operator's repository, tag and digest and the training runtime's
# trainer repository (comments kept: `helm show values` still documents every key).
# Writes $DIST/rlhf-operator-<version>.tgz, $DIST/rlhf_operator-<version>.tar.gz and -py3-none-any.whl,
# and $DIST/release.json (what was published where, with digests); prints the same summary.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "release: $*" >&2; exit 2; }
log() { echo "release: $*" >&2; }

# ---- inputs ---------------------------------------------------------------------------------
REGISTRY="${REGISTRY:-}"
[[ -n "$REGISTRY" ]] || die "REGISTRY is not set: give the registry the images were pushed to, e.g. REGISTRY=ghcr.io/rlhf-operator (the chart goes to oci://\$REGISTRY/charts)"
REGISTRY="${REGISTRY%/}"
[[ "$REGISTRY" != *://* ]] || die "REGISTRY=$REGISTRY: give it without a scheme (host[:port]/path, e.g. ghcr.io/rlhf-operator); for plain HTTP set PLAIN_HTTP=1"
[[ "$REGISTRY" =~ ^[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)*$ ]] \
    || die "REGISTRY=$REGISTRY is not a registry path (host[:port]/path, lower case), e.g. ghcr.io/rlhf-operator"
case "${PLAIN_HTTP:-0}" in
    1) PLAIN=(--plain-http) ;;
    0 | "") PLAIN=() ;;
    *) die "PLAIN_HTTP=$PLAIN_HTTP: set it to 1 (plain HTTP to the registry) or 0" ;;
esac
DIST="${DIST:-$REPO/dist}"
IMAGES_LOCK="${IMAGES_LOCK:-$DIST/images.lock.json}"
if [[ -n "${HELM:-}" ]]; then
    [[ -x "$HELM" ]] || die "HELM=$HELM is not an executable file: set HELM to the helm binary"
else
    HELM="$(command -v helm || true)"
    [[ -n "$HELM" ]] || die "helm not found: put it on PATH or set HELM=/path/to/helm"
fi
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON="$(command -v python3 || true)"; fi
fi
[[ -n "$PYTHON" ]] && "$PYTHON" -c "import yaml" 2>/dev/null \
    || die "no Python with pyyaml (${PYTHON:-none found}): set PYTHON=, or create the venv (make venv)"
if [[ -z "${UV:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/uv" ]]; then UV="$REPO/.venv/bin/uv"; else UV="$(command -v uv || true)"; fi
fi
[[ -f "$IMAGES_LOCK" ]] || die "IMAGES_LOCK=$IMAGES_LOCK does not exist: build and push the images first (make images IMAGE_REGISTRY=$REGISTRY writes it), or point IMAGES_LOCK at the lock file"

# ---- the one version, and the lock's images ---------------------------------------------------
# prints: VERSION, then <name> <image> <digest> for each image
checked="$("$PYTHON" - "$REPO" "$IMAGES_LOCK" "$REGISTRY" <<'EOF'
import json, re, sys, tomllib
from pathlib import Path

import yaml

repo, lock_path, registry = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
ns = {}
exec((repo / "contract/rlhf_contract/images.py").read_text(), ns)
chart = yaml.safe_load((repo / "charts/rlhf-operator/Chart.yaml").read_text())
versions = {"pyproject.toml version": tomllib.loads((repo / "pyproject.toml").read_text())["project"]["version"],
            "contract/rlhf_contract/images.py VERSION": ns["VERSION"],
            "charts/rlhf-operator/Chart.yaml version": str(chart["version"]),
            "charts/rlhf-operator/Chart.yaml appVersion": str(chart["appVersion"])}
if len(set(versions.values())) != 1:
    sys.exit("the versions differ; set them to one: " + ", ".join(f"{k} = {v}" for k, v in versions.items()))
version = ns["VERSION"]
try:
    lock = json.loads(Path(lock_path).read_text())
except (OSError, ValueError) as err:
    sys.exit(f"IMAGES_LOCK={lock_path}: not a JSON file ({err})")
if not isinstance(lock, dict):
    sys.exit(f"IMAGES_LOCK={lock_path}: expected an object of images by name")
problems, rows = [], []
for name in ("operator", "trainer", "inference", "colocated"):
    entry, want = lock.get(name), f"{registry}/{name}:{version}"
    if not isinstance(entry, dict):
        problems.append(f"{name}: missing (build and push it: make images IMAGE_REGISTRY={registry})")
        continue
    image, digest = entry.get("image"), entry.get("digest")
    if image != want:
        problems.append(f"{name}.image is {image!r}, this release needs {want!r} (rebuild the images for "
                        f"REGISTRY={registry} at version {version}, or set REGISTRY to where they are)")
    if not isinstance(digest, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        problems.append(f"{name}.digest is {digest!r}, not a sha256:<64 hex> manifest digest")
    rows.append(f"{name} {image} {digest}")
if problems:
    sys.exit(f"IMAGES_LOCK={lock_path}:\n  " + "\n  ".join(problems))
print(version)
print("\n".join(rows))
EOF
)" || die "cannot release (see above)"
VERSION="$(head -n1 <<<"$checked")"
IMAGE_ROWS="$(tail -n +2 <<<"$checked")"
OPERATOR_DIGEST="$(awk '$1 == "operator" {print $3}' <<<"$IMAGE_ROWS")"
log "version $VERSION, images of $IMAGES_LOCK"
COMMIT="$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)"
DIRTY="$(git -C "$REPO" status --porcelain 2>/dev/null | head -c1)"
[[ -z "$DIRTY" ]] || log "warning: the working tree has uncommitted changes; the chart and the package are built from it as it is"

# ---- the chart: a copy with the released images in its values --------------------------------
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
cp -R "$REPO/charts/rlhf-operator" "$TMP/rlhf-operator"
"$PYTHON" - "$TMP/rlhf-operator/values.yaml" "$REGISTRY/operator" "$VERSION" "$OPERATOR_DIGEST" "$REGISTRY/trainer" <<'EOF' \
    || die "could not write the released images into the chart's values (see above)"
"""Sets values by their key path, line by line: comments (the values' documentation) stay."""
import copy, json, re, sys
from pathlib import Path

import yaml

path, operator_repo, version, digest, trainer_repo = sys.argv[1:]
targets = {("image", "repository"): operator_repo, ("image", "tag"): version, ("image", "digest"): digest,
           ("trainingRuntime", "image", "repository"): trainer_repo}
text = Path(path).read_text()
before = yaml.safe_load(text)
stack, hits, out = [], {}, []
for line in text.splitlines(keepends=True):
    m = re.match(r"^( *)([A-Za-z0-9_]+):(?: (.*))?$", line.rstrip("\n"))
    if m:
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        key = tuple(k for _, k in stack)
        if key in targets:
            hits[key] = hits.get(key, 0) + 1
            line = f"{m.group(1)}{m.group(2)}: {json.dumps(targets[key])}\n"
    out.append(line)
wrong = {".".join(k): hits.get(k, 0) for k in targets if hits.get(k, 0) != 1}
if wrong:
    sys.exit(f"values.yaml: each key must be found once, found {wrong}")
new = "".join(out)
after, expect = yaml.safe_load(new), copy.deepcopy(before)
for key, value in targets.items():
    node = expect
    for k in key[:-1]:
        node = node[k]
    node[key[-1]] = value
if after != expect:
    sys.exit("values.yaml: the edit changed more than the images' keys")
Path(path).write_text(new)
EOF
want_image="$REGISTRY/operator:$VERSION@$OPERATOR_DIGEST"
rendered="$("$HELM" template rel "$TMP/rlhf-operator" --namespace rlhf-system --kube-version 1.34.0 \
    --show-only templates/deployment.yaml)" || die "helm template of the released chart failed (see above)"
grep -qF "image: $want_image" <<<"$rendered" \
    || die "the released chart's Deployment does not run $want_image:"$'\n'"$(grep 'image:' <<<"$rendered")"
mkdir -p "$DIST"
"$HELM" package "$TMP/rlhf-operator" --destination "$DIST" >&2
CHART_TGZ="$DIST/rlhf-operator-$VERSION.tgz"
[[ -f "$CHART_TGZ" ]] || die "helm package wrote no $CHART_TGZ"

# ---- push the chart ----------------------------------------------------------------------------
push_out="$("$HELM" push "$CHART_TGZ" "oci://$REGISTRY/charts" "${PLAIN[@]}" 2>&1)" || {
    echo "$push_out" >&2
    die "helm push to oci://$REGISTRY/charts failed (a registry that wants a login: helm registry login ${REGISTRY%%/*}; plain HTTP: PLAIN_HTTP=1)"
}
echo "$push_out" >&2
CHART_DIGEST="$(sed -n 's/^Digest: *\(sha256:[0-9a-f]\{64\}\).*/\1/p' <<<"$push_out" | head -n1)"
[[ -n "$CHART_DIGEST" ]] || die "helm push printed no 'Digest: sha256:...' line"
CHART_REF="oci://$REGISTRY/charts/rlhf-operator"

# ---- the Python package --------------------------------------------------------------------------
rm -f "$DIST/rlhf_operator-$VERSION.tar.gz" "$DIST/rlhf_operator-$VERSION-py3-none-any.whl"
if [[ -n "$UV" ]]; then
    "$UV" build --quiet --out-dir "$DIST" "$REPO" >&2
else
    "$PYTHON" -m build --outdir "$DIST" "$REPO" >&2 \
        || die "no uv (set UV=), and python -m build failed (is the build package installed?)"
fi
SDIST="$DIST/rlhf_operator-$VERSION.tar.gz"
WHEEL="$DIST/rlhf_operator-$VERSION-py3-none-any.whl"
[[ -f "$SDIST" && -f "$WHEEL" ]] || die "the build wrote no $SDIST and $WHEEL"

# ---- summary ---------------------------------------------------------------------------------------
"$PYTHON" - "$DIST/release.json" "$VERSION" "$CHART_REF" "$CHART_DIGEST" "$CHART_TGZ" "$SDIST" "$WHEEL" "$IMAGE_ROWS" \
    "${PLAIN[*]}" "$COMMIT" "${DIRTY:+dirty}" <<'EOF'
import hashlib, json, sys
from pathlib import Path

out, version, chart_ref, chart_digest, tgz, sdist, wheel, rows, plain, commit, dirty = sys.argv[1:]
sha = lambda p: "sha256:" + hashlib.sha256(Path(p).read_bytes()).hexdigest()
images = {name: {"image": image, "digest": digest, "ref": f"{image}@{digest}"}
          for name, image, digest in (r.split() for r in rows.splitlines())}
release = {"version": version, "commit": commit, "uncommittedChanges": bool(dirty),
           "chart": {"ref": f"{chart_ref}:{version}", "digest": chart_digest, "package": tgz,
                     "install": f"helm install rlhf {chart_ref} --version {version} -n rlhf-system --create-namespace"
                                + (f" {plain}" if plain else "")},
           "images": images,
           "python": {"sdist": {"path": sdist, "sha256": sha(sdist)}, "wheel": {"path": wheel, "sha256": sha(wheel)}}}
Path(out).write_text(json.dumps(release, indent=2) + "\n")
print(f"Released rlhf-operator {version}")
print(f"  chart   {chart_ref}:{version}@{chart_digest}")
print(f"          (the operator image by tag and digest: {images['operator']['ref']})")
for name, image in images.items():
    print(f"  image   {image['ref']}")
print(f"  python  {wheel}  ({sha(wheel)})")
print(f"          {sdist}  ({sha(sdist)})")
print(f"  install: {release['chart']['install']}")
print(f"  record:  {out}")
EOF
