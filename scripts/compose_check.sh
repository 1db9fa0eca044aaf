#!/usr/bin/env bash
# The compose deployment for real: build the images, bring up deploy/docker-compose.yml under a Docker engine and
# check it from the host (chaos/compose_check.py: generations over gRPC and HTTP, draft/target containers killed
# mid-stream, Redis restarted, down -v). Exit status non-zero on any failure. Run as root (or a docker group user).
#
#   bash scripts/compose_check.sh            # reuse images and build caches where present
#   bash scripts/compose_check.sh --fresh    # first remove the images and BuildKit's caches (a cold build)
#
# Environment: PYTHON (default .venv/bin/python: specdec and openai installed), SPECDEC_BASE_IMAGE (a base image to
# build on instead of pulling python:3.11-slim or making local/debian:bookworm), SPECDEC_BUILD_CA (CA bundle for
# pip inside the build; default the host's /etc/ssl/certs/ca-certificates.crt), TORCH_WHEEL_DIR (a directory with
# torch-2.13.0+cpu wheels to serve to the build; default the host pip's find-links when it has one; served on
# the docker bridge at port TORCH_WHEEL_PORT, default 18765).
set -euo pipefail
cd "$(dirname "$0")/.."
fresh=0
for arg in "$@"; do
  case "$arg" in
    --fresh) fresh=1 ;;
    *) echo "usage: $0 [--fresh]" >&2; exit 2 ;;
  esac
done
PYTHON=${PYTHON:-.venv/bin/python}
PROJECT=specdec
t_all=$(date +%s)
say() { echo "== $*"; }
elapsed() { echo $(( $(date +%s) - $1 )); }

# --- the engine --------------------------------------------------------------------------------------------------
started_dockerd=""
if ! docker info >/dev/null 2>&1; then
  say "no Docker engine answers: starting dockerd (log: /tmp/specdec-dockerd.log)"
  dockerd >/tmp/specdec-dockerd.log 2>&1 &
  started_dockerd=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { echo "dockerd did not come up" >&2; exit 1; }
fi
# A CLI that builds with BuildKit: buildx, or a client older than 23 (BuildKit built in).
build_cli=""
for cli in docker /usr/bin/docker; do
  command -v "$cli" >/dev/null 2>&1 || continue
  if "$cli" buildx version >/dev/null 2>&1; then build_cli=$cli; break; fi
  major=$("$cli" --version 2>/dev/null | sed -nE 's/^Docker version ([0-9]+)\..*/\1/p')
  if [ -n "$major" ] && [ "$major" -lt 23 ]; then build_cli=$cli; break; fi
done
[ -n "$build_cli" ] || { echo "no docker CLI here can build with BuildKit (install buildx)" >&2; exit 1; }
if command -v docker-compose >/dev/null 2>&1; then compose="docker-compose"; else compose="docker compose"; fi
say "engine $(docker version --format '{{.Server.Version}}'), builds with $build_cli, $($compose version --short 2>/dev/null || $compose version | head -1)"

files=(-f deploy/docker-compose.yml -f deploy/docker-compose.noregistry.yml)
$compose -p $PROJECT "${files[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
if [ $fresh = 1 ]; then
  say "--fresh: removing the images and BuildKit's build cache (pip's cache mounts included)"
  docker image rm -f specdec:cpu specdec-redis:local local/debian:bookworm >/dev/null 2>&1 || true
  "$build_cli" builder prune -af >/dev/null
fi

# --- images ------------------------------------------------------------------------------------------------------
t_build=$(date +%s)
base=${SPECDEC_BASE_IMAGE:-}
if [ -z "$base" ]; then
  if docker image inspect python:3.11-slim >/dev/null 2>&1 || timeout 60 docker pull -q python:3.11-slim >/dev/null 2>&1; then
    base=python:3.11-slim
  else
    say "no container registry: the base image is local/debian:bookworm (made from the Debian mirror if absent)"
    DOCKER=docker bash scripts/make_local_base.sh local/debian:bookworm
    base=local/debian:bookworm
  fi
fi
build_args=(--build-arg "BASE_IMAGE=$base")
ca=${SPECDEC_BUILD_CA:-/etc/ssl/certs/ca-certificates.crt}
[ -s "$ca" ] && build_args+=(--secret "id=pip_ca,src=$ca")
wheels=${TORCH_WHEEL_DIR:-$("$PYTHON" -m pip config get global.find-links 2>/dev/null || true)}
wheel_server=""
cleanup() {
  [ -n "$wheel_server" ] && kill "$wheel_server" 2>/dev/null || true
  [ -n "$started_dockerd" ] && kill "$started_dockerd" 2>/dev/null || true
}
trap cleanup EXIT
if [ -n "$wheels" ] && ls "$wheels"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  # Served on the docker bridge for the build only (pip --find-links); nothing else from the host goes in.
  # A fixed address and port: TORCH_FIND_LINKS is part of the build cache's key (a new URL rebuilds every layer
  # after it).
  bridge=$(docker network inspect bridge -f '{{(index .IPAM.Config 0).Gateway}}' 2>/dev/null || true)
  [ -n "$bridge" ] || bridge=$(ip -4 -o addr show docker0 | awk '{print $4}' | cut -d/ -f1)
  port=${TORCH_WHEEL_PORT:-18765}
  "$PYTHON" -m http.server "$port" --bind "$bridge" --directory "$wheels" >/tmp/specdec-wheels-http.log 2>&1 &
  wheel_server=$!
  sleep 1
  kill -0 "$wheel_server" || { echo "could not serve $wheels on $bridge:$port (TORCH_WHEEL_PORT)" >&2; exit 1; }
  build_args+=(--build-arg "TORCH_FIND_LINKS=http://$bridge:$port/")
  say "torch's CPU wheel from $wheels (served on http://$bridge:$port/ to the build)"
fi
say "building specdec:cpu on $base"
DOCKER_BUILDKIT=1 "$build_cli" build -q -f deploy/Dockerfile "${build_args[@]}" -t specdec:cpu . >/dev/null
say "building specdec-redis:local (Debian's redis-server) on $base"
DOCKER_BUILDKIT=1 "$build_cli" build -q -f deploy/Dockerfile.redis --build-arg "BASE_IMAGE=$base" \
  -t specdec-redis:local deploy >/dev/null
[ -n "$wheel_server" ] && kill "$wheel_server" && wheel_server=""
echo "[TIME] build (base image, specdec:cpu, specdec-redis:local): $(elapsed "$t_build") s"
docker image ls --format '   {{.Repository}}:{{.Tag}} {{.Size}}' | grep -E 'specdec|local/debian' || true

# --- the stack, checked from the host ----------------------------------------------------------------------------
# One thread for the target (compose's default is 2): on a 2-core host the target, the drafts and the orchestrator
# share the cores, and two OpenMP threads on an oversubscribed host wait on each other.
export TARGET_THREADS=${TARGET_THREADS:-1}
say "compose up and the checks (chaos/compose_check.py), TARGET_THREADS=$TARGET_THREADS"
rc=0
"$PYTHON" -m chaos.compose_check --project $PROJECT --compose "$compose" \
  --compose-file deploy/docker-compose.yml --compose-file deploy/docker-compose.noregistry.yml || rc=$?
left=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" | wc -l)
echo "[TIME] total: $(elapsed "$t_all") s; containers of project $PROJECT left: $left"
[ "$left" = 0 ] || rc=1
exit $rc
