"""Write a smaller copy of Ray's wheel for a machine that only runs the Ray backend: Ray's wheel (~79 MB) is more
than one device call can carry (64 MiB), and a third of it is Ray's Java jar, which Serve never loads, plus the
RL, data, training and tuning libraries and the dashboard's web page (the Ray backend starts no dashboard).

`python scripts/strip_ray_wheel.py ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl OUT_DIR` writes the wheel of the
same name into OUT_DIR (~40 MB), its RECORD rewritten to list what is left. `pip install --no-deps` installs it.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

# Packages of ray that `ray[serve]` never imports (a replica, the Serve controller, the front and the cluster's
# daemons run without them: tests/serve/test_ray_backend.py passes on a copy without them).
DROPPED = ("ray/jars/", "ray/rllib/", "ray/data/", "ray/train/", "ray/tune/", "ray/llm/", "ray/air/examples/",
           "ray/dashboard/client/")


def strip(wheel: Path, out_dir: Path) -> Path:
    out = out_dir / wheel.name
    out_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
        kept = [item for item in source.infolist() if not item.filename.startswith(DROPPED)]
        names = {item.filename for item in kept}
        for item in kept:
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(line for line in lines if line.split(",")[0] in names or not line) + "\n").encode()
            target.writestr(item, data)
    return out


if __name__ == "__main__":
    path = strip(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"{path} {path.stat().st_size / 1e6:.1f} MB")
