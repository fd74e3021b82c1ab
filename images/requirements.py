"""Prints the third-party requirements of tpusync (pyproject.toml) with the given extras, one per
line, so an image installs them in a layer of its own that changes only with pyproject.toml.

    python requirements.py pyproject.toml [EXTRA...]
"""

import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
lines = list(project["dependencies"])
for extra in sys.argv[2:]:
    lines += project["optional-dependencies"][extra]
print("\n".join(lines))
