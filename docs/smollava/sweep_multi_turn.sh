#!/usr/bin/env bash
# The multi-turn table (issue 22): 16 held-out chats, each 8 captioned images then 4-8 questions
# about different images, asked one turn at a time on the compressed cache (kivi2 keeps every entry
# in 2 bits at budget 1.0: run it in a folder of its own).
TASK=multi_turn ITEMS=16 exec bash "$(dirname "$0")/sweep.sh" "$@"
