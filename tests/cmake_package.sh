#!/usr/bin/env bash
# Kept where users and docs call it; the script is scripts/cmake-package-test.sh.
exec bash "$(dirname "$0")/../scripts/cmake-package-test.sh" "$@"
