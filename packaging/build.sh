#!/usr/bin/env bash
# `make package`: the default model converted for shipping, a PyInstaller one-folder bundle,
# and from it dist/phasewise_<version>_amd64.deb. Intermediate files stay in build/ so a rerun
# only redoes what changed (the model step is skipped when build/bundled-model is current).
set -euo pipefail
cd "$(dirname "$0")/.."

py=${PYTHON:-.venv/bin/python}
# pyproject.toml is the single source of the version (no tomllib: Python 3.10 lacks it).
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)
[[ -n $version ]] || { echo "package: no version in pyproject.toml" >&2; exit 1; }
start=$SECONDS

echo "package: default model -> build/bundled-model"
"$py" packaging/prepare_model.py build/bundled-model

# What the bundle was built from: the packaging tests refuse a bundle of other sources.
"$py" packaging/source_stamp.py build/source-stamp.json

echo "package: PyInstaller bundle -> build/dist/phasewise"
"$py" -m PyInstaller --noconfirm --log-level WARN \
    --distpath build/dist --workpath build/pyinstaller packaging/phasewise.spec

# The bundle must report the pyproject version (About box, package name); catch a stale one.
bundled=$(env -i PATH=/usr/bin:/bin HOME="$(mktemp -d)" build/dist/phasewise/phasewise --version)
[[ $bundled == "phasewise $version" ]] || {
    echo "package: bundle says '$bundled', pyproject says $version" >&2; exit 1; }

echo "package: Debian package -> dist/"
deb=$(bash packaging/linux/build_deb.sh build/dist/phasewise "$version" dist)

echo "package: done in $((SECONDS - start)) s"
echo "  bundle  $(du -sh build/dist/phasewise | cut -f1)  build/dist/phasewise"
echo "  .deb    $(du -sh "$deb" | cut -f1)  $deb"
