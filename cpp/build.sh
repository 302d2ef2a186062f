#!/usr/bin/env bash
# Kept where users and docs call it; the script is scripts/build-torch-ext.sh.
exec bash "$(dirname "$0")/../scripts/build-torch-ext.sh" "$@"
