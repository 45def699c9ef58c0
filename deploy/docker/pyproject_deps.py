"""Print the runtime dependencies of a pyproject.toml, one per line (a requirements file),
plus those of the optional extras named after the file (`pyproject_deps.py pyproject.toml
frontend`).

The Dockerfile installs them in their own layer before copying the code, so a code change does
not reinstall grpcio & co. Python 3.11+ has tomllib; older images install tomli first.
"""

import sys

try:
    import tomllib
except ImportError:  # Python 3.10 (e.g. Ubuntu 22.04 based CUDA images)
    import tomli as tomllib

with open(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
deps = list(project["dependencies"])
for extra in sys.argv[2:]:
    deps += project["optional-dependencies"][extra]
print("\n".join(deps))
