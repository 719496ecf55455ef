#!/usr/bin/env bash
# Submit the ingest pipeline to a Ray cluster as a Ray job:
#   ray job submit --address ADDRESS --working-dir REPO --runtime-env-json '{...}' -- python -m ingest run CONFIG ...
#
# Usage: deploy/submit.sh [options] CONFIG.yaml [-- extra `python -m ingest run` arguments]
#   --address URL          dashboard address (default: $RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS, else
#                          http://127.0.0.1:8265)
#   --pip                  also install requirements/main.txt (less ray itself) in the job's runtime env, for a
#                          cluster that runs a plain rayproject/ray image instead of docker/Dockerfile's
#   --submission-id ID     job id (default: Ray picks one)
#   --auth-token-file P    read the Ray auth token from P (sets RAY_AUTH_TOKEN_PATH)
#   --no-auth              RAY_AUTH_MODE=disabled (a loopback test cluster started with RAY_AUTH_MODE=disabled)
#   --no-wait              return once the job is submitted (default: stream its logs, exit 1 if it fails)
#   --dry-run              print the command (and the auth source) instead of running it
#
# Token authentication (Ray >= 2.52; local clusters have it on by default since Ray 2.59): the job client sends the
# token only when RAY_AUTH_MODE=token is set in its environment. Unless RAY_AUTH_MODE is already set, this script sets
# it when a token is found: $RAY_AUTH_TOKEN, then $RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token (the file `ray start` /
# `ray.init()` use; Ray reads it itself). The token is never printed and never put in the runtime env.
#
# CONFIG must be a file inside this repository (it is uploaded with the working dir) or, if it does not exist here, a
# path on the cluster (e.g. /home/ray/ray-ingest/deploy/configs/text.yaml in the docker/Dockerfile image).
set -euo pipefail

die() {
    echo "submit.sh: $*" >&2
    exit 2
}

usage() {
    sed -n '2,/^set -euo pipefail$/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
}

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"
PYTHON="${PYTHON:-python3}"

ADDRESS="${RAY_API_SERVER_ADDRESS:-${RAY_ADDRESS:-http://127.0.0.1:8265}}"
USE_PIP=0
DRY_RUN=0
SUBMISSION_ID=""
EXTRA_SUBMIT_ARGS=()
CONFIG=""

while [[ $# -gt 0 ]]; do
    case "$1" in
        --address)
            [[ $# -ge 2 ]] || die "--address needs a value"
            ADDRESS="$2"
            shift 2
            ;;
        --address=*)
            ADDRESS="${1#*=}"
            shift
            ;;
        --pip)
            USE_PIP=1
            shift
            ;;
        --submission-id)
            [[ $# -ge 2 ]] || die "--submission-id needs a value"
            SUBMISSION_ID="$2"
            shift 2
            ;;
        --auth-token-file)
            [[ $# -ge 2 ]] || die "--auth-token-file needs a value"
            export RAY_AUTH_TOKEN_PATH="$2"
            shift 2
            ;;
        --no-auth)
            export RAY_AUTH_MODE=disabled
            shift
            ;;
        --no-wait)
            EXTRA_SUBMIT_ARGS+=(--no-wait)
            shift
            ;;
        --dry-run)
            DRY_RUN=1
            shift
            ;;
        -h | --help)
            usage
            exit 0
            ;;
        --)
            shift
            break
            ;;
        -*)
            die "unknown option $1 (see --help)"
            ;;
        *)
            if [[ -z "$CONFIG" ]]; then
                CONFIG="$1"
                shift
            else
                break
            fi
            ;;
    esac
done
[[ -n "$CONFIG" ]] || die "no CONFIG.yaml given (see --help)"
# What is left in "$@" goes to `python -m ingest run` after CONFIG.

# Entry point config: a local file must lie inside the uploaded working dir; name it relative to it.
if [[ -f "$CONFIG" ]]; then
    CONFIG_ABS="$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")"
    case "$CONFIG_ABS" in
        "$REPO_ROOT"/*) CONFIG_ARG="${CONFIG_ABS#"$REPO_ROOT"/}" ;;
        *) die "$CONFIG is outside $REPO_ROOT, so it would not be uploaded; copy it under deploy/configs/" ;;
    esac
else
    echo "submit.sh: $CONFIG does not exist here; passing it as a path on the cluster" >&2
    CONFIG_ARG="$CONFIG"
fi

# Token authentication for the job client (see the header).
AUTH_SOURCE="RAY_AUTH_MODE=${RAY_AUTH_MODE:-} (set by the caller)"
if [[ -z "${RAY_AUTH_MODE:-}" ]]; then
    if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then
        AUTH_SOURCE="token from \$RAY_AUTH_TOKEN"
    elif [[ -n "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
        [[ -s "$RAY_AUTH_TOKEN_PATH" ]] || die "RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH is missing or empty"
        AUTH_SOURCE="token from $RAY_AUTH_TOKEN_PATH"
    elif [[ -s "$HOME/.ray/auth_token" ]]; then
        AUTH_SOURCE="token from ~/.ray/auth_token"
    else
        AUTH_SOURCE=""
    fi
    if [[ -n "$AUTH_SOURCE" ]]; then
        export RAY_AUTH_MODE=token
    else
        AUTH_SOURCE="no token found: submitting without authentication"
    fi
fi

# Runtime env: the repo as working dir (uploaded by the client), less environments, caches and outputs. Ray also
# honours .gitignore / .rayignore in the working dir; the explicit list keeps the upload small either way.
RUNTIME_ENV="$(
    REPO_ROOT="$REPO_ROOT" USE_PIP="$USE_PIP" "$PYTHON" - <<'PY'
import json
import os
import re

env = {
    "excludes": [".git", ".venv", ".oracle", ".oracle-0.6", ".oracle-0.7", ".oracle-0.8", ".oracle-0.9", ".cache", "out",
                 "build", "**/__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache"],
    "env_vars": {"PYTHONUNBUFFERED": "1"},
}
if os.environ["USE_PIP"] == "1":
    with open(os.path.join(os.environ["REPO_ROOT"], "requirements", "main.txt")) as f:
        lines = [line.split("#", 1)[0].strip() for line in f]
    # Ray itself comes from the cluster: a runtime env must not reinstall it.
    env["pip"] = [line for line in lines if line and re.split(r"[\[=<>!~; ]", line, maxsplit=1)[0] != "ray"]
print(json.dumps(env))
PY
)"

CMD=(ray job submit --address "$ADDRESS" --working-dir "$REPO_ROOT" --runtime-env-json "$RUNTIME_ENV")
if [[ -n "$SUBMISSION_ID" ]]; then
    CMD+=(--submission-id "$SUBMISSION_ID")
fi
CMD+=(${EXTRA_SUBMIT_ARGS[@]+"${EXTRA_SUBMIT_ARGS[@]}"} -- python -m ingest run "$CONFIG_ARG" "$@")

echo "submit.sh: auth: $AUTH_SOURCE" >&2
if [[ "$DRY_RUN" == 1 ]]; then
    echo "RAY_AUTH_MODE=${RAY_AUTH_MODE:-}"
    printf '%q ' "${CMD[@]}"
    echo
    exit 0
fi
command -v ray >/dev/null 2>&1 || die "the ray CLI is not on PATH (pip install 'ray[default]==2.60.0')"
exec "${CMD[@]}"
