#!/usr/bin/env bash
# Kept where users and docs call it; the script is scripts/simcuda-mutations.sh.
exec bash "$(dirname "$0")/../scripts/simcuda-mutations.sh" "$@"
