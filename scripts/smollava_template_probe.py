"""Zero-shot probe: does the 8-image binding change when each image is also labelled after it?

    python scripts/smollava_template_probe.py close --weights vlm_kv/models/pretrained/smollava \
        --items 32 --tasks multi_image --n-images 8

The first argument picks how the captioned images are written: ``base`` (the task's own
"Image k: caption.\\n<image>\\n") or ``close`` (the same plus "End of image k.\\n" after each image);
every other argument goes to ``scripts/smollava_eval.py``. The shipped model was trained on the
base layout only, so this measures whether the frozen model already uses a closing label, not
what training with one would give (session 24: 15 of 32 either way, the same per kind).
"""

import runpy
import sys
from pathlib import Path

import vlm_kv.eval.visual_tasks as tasks

layout = sys.argv.pop(1)
if layout == "close":
    tasks._captioned = lambda scenes: "".join(
        f"Image {k + 1}: {s.caption}.\n{tasks.IMAGE_MARK}\nEnd of image {k + 1}.\n" for k, s in enumerate(scenes))
elif layout != "base":
    raise SystemExit(f"layout must be base or close, got {layout!r}")
script = Path(__file__).with_name("smollava_eval.py")
sys.argv[0] = str(script)
runpy.run_path(str(script), run_name="__main__")
