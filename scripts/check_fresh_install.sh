#!/usr/bin/env bash
# The README's set-up on its own: a venv from requirements.txt alone (no dev extras, so on a CPU machine no Triton),
# then, on the built-in tiny model, the README's CLI example and one song through the app's `generate` API
# (`python app.py --model tiny` in the background, one gradio_client request). CI runs it before the test suite, whose
# dev requirements would hide a missing dependency. By hand: `bash scripts/check_fresh_install.sh`; FRESH_VENV=DIR
# keeps the venv in DIR (made if missing) instead of a temporary one.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "[fresh-install] $*"; }
fail() { say "FAILED: $*"; exit 1; }

started=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/music3-fresh.XXXXXX")
venv=${FRESH_VENV:-$work/venv}
server_pid=""
cleanup() {
  if [[ -n $server_pid ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
# Nothing from the caller's environment may reach the fresh venv's Python (a dev checkout's PYTHONPATH, CI's
# Triton interpreter switch).
unset PYTHONPATH TRITON_INTERPRET VIRTUAL_ENV

say "venv from requirements.txt alone: $venv"
[[ -x $venv/bin/python ]] || python3 -m venv "$venv"
py=$venv/bin/python
# --no-compile: byte-compiling every installed file (torch's thousands) is most of the install's CPU time; Python
# compiles what it imports on first use anyway.
"$py" -m pip install -q --no-compile -r requirements.txt || fail "pip install -r requirements.txt"
if "$py" -c "import triton" 2>/dev/null; then
  say "triton: installed (a dependency of this platform's torch build); the run below still uses only the CPU path"
else
  say "triton: not installed, as on a CPU machine"
fi
say "installed in $((SECONDS - started)) s"

step=$SECONDS
printf '[verse]\nhello from a fresh install\n' > "$work/lyrics.txt"
say "CLI: python -m music3_demo generate --model tiny ... --duration 1 --out $work/song.wav"
"$py" -m music3_demo generate --model tiny --prompt "dreamy synth-pop, 100 BPM, female vocals" \
  --lyrics-file "$work/lyrics.txt" --duration 1 --seed 42 --out "$work/song.wav" --quiet \
  || fail "the README's CLI example exited with status $?"
"$py" - "$work/song.wav" <<'EOF' || fail "the CLI's song is not a valid audio file"
import sys
import soundfile as sf

info = sf.info(sys.argv[1])
assert (info.samplerate, info.channels) == (44100, 2) and info.frames > 0, info
print(f"[fresh-install] CLI song: {info.duration:.2f} s, {info.samplerate} Hz, {info.channels} channels")
EOF
say "CLI done in $((SECONDS - step)) s"

step=$SECONDS
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
say "app: python app.py --model tiny --port $port (log: $work/app.log), one request to the generate endpoint"
"$py" app.py --model tiny --port "$port" --output-dir "$work/songs" > "$work/app.log" 2>&1 &
server_pid=$!
if ! "$py" scripts/api_song.py "http://127.0.0.1:$port/" --server-pid "$server_pid" --timeout 300; then
  say "app log (last 40 lines):"
  tail -n 40 "$work/app.log" || true
  fail "one song through the app's API"
fi
kill "$server_pid"
wait "$server_pid" 2>/dev/null || true
server_pid=""
say "API song done in $((SECONDS - step)) s"
say "OK in $((SECONDS - started)) s: requirements.txt alone runs the README's CLI example and the app's API"
