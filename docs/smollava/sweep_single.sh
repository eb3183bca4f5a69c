#!/usr/bin/env bash
# The single-image table (issue 22): 48 held-out items, one image and one question each.
TASK=single ITEMS=48 exec bash "$(dirname "$0")/sweep.sh" "$@"
