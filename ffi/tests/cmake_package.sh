#!/usr/bin/env bash
# Beside the C tests it runs; the script is scripts/cmake-package-test.sh.
exec bash "$(dirname "$0")/../../scripts/cmake-package-test.sh" "$@"
