#!/usr/bin/env bash
# `make run` on a fresh clone serves a completion at the URL it prints (issue 7's acceptance).
#
# Clones the committed tree into a temporary directory, runs `make run` there (which creates the
# virtual environment, installs everything and starts the stack) with NATS, Redis and the gateway
# on free ports, waits for "is serving", posts a completion, checks the answer, then stops the
# stack with Ctrl-C (SIGINT) and checks that it exits cleanly.
#
#   bash scripts/check-make-run.sh        # prints PASS or FAIL with the log
set -euo pipefail

repo=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

git clone -q "$repo" "$work/dls"
cd "$work/dls"
export DLS_GATEWAY_PORT=$(free_port)
export DLS_NATS_URL="nats://127.0.0.1:$(free_port)" DLS_REDIS_URL="redis://127.0.0.1:$(free_port)/0"
setsid make run > run.log 2>&1 &
pid=$!

url=""
for _ in $(seq 900); do
  if grep -q "is serving" run.log; then url=$(grep "is serving" run.log | sed 's/.* at //'); break; fi
  if ! kill -0 "$pid" 2>/dev/null; then break; fi
  sleep 1
done
status=FAIL
if [ -n "$url" ]; then
  echo "make run is serving at $url"
  answer=$(curl -s "$url/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "dls-tiny", "prompt": "347+589=", "max_tokens": 16}')
  echo "$answer"
  text=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["choices"][0]["text"].strip())' "$answer" || true)
  [ "$text" = "936" ] && status=PASS
fi
kill -INT -- -"$pid" 2>/dev/null || true
# make and dls up share the process group; the services run in sessions of their own under dls up
for _ in $(seq 120); do pgrep -g "$pid" > /dev/null || break; sleep 1; done
if pgrep -g "$pid" > /dev/null; then echo "the stack did not stop within 120 s"; status=FAIL; kill -KILL -- -"$pid"; fi
if pgrep -f "$work/dls" > /dev/null; then echo "processes outlived the stack:"; pgrep -af "$work/dls"; status=FAIL; fi
if [ "$status" = FAIL ]; then tail -40 run.log; fi
echo "$status"
[ "$status" = PASS ]
