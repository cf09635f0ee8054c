#!/usr/bin/env bash
# macOS: Phasewise.app (PyInstaller, from the shared spec) inside a compressed .dmg.
# Run on a Mac from the repository root after `make setup` (see packaging/README.md):
#   bash packaging/macos/build_dmg.sh
# Output: dist/Phasewise-<version>.dmg. The app is unsigned: sign and notarize it
# (codesign --deep --options runtime, xcrun notarytool) before handing it to users.
set -euo pipefail
cd "$(dirname "$0")/../.."

[[ $(uname -s) == Darwin ]] || { echo "build_dmg.sh: runs on macOS only (needs hdiutil)" >&2; exit 1; }
py=${PYTHON:-.venv/bin/python}
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)

"$py" -m pip install --quiet "pyinstaller>=6.10"
"$py" packaging/prepare_model.py build/bundled-model
# On macOS the spec adds a BUNDLE step: build/dist/Phasewise.app next to the plain folder.
"$py" -m PyInstaller --noconfirm --log-level WARN \
    --distpath build/dist --workpath build/pyinstaller packaging/phasewise.spec

# The Info.plist version comes from pyproject.toml, as on the other platforms.
plist=build/dist/Phasewise.app/Contents/Info.plist
/usr/libexec/PlistBuddy -c "Set :CFBundleShortVersionString $version" "$plist" 2>/dev/null \
    || /usr/libexec/PlistBuddy -c "Add :CFBundleShortVersionString string $version" "$plist"

# A folder with the app and a link to /Applications: the usual drag-to-install window.
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cp -R build/dist/Phasewise.app "$stage/"
ln -s /Applications "$stage/Applications"
mkdir -p dist
hdiutil create -volname "Phasewise $version" -srcfolder "$stage" -fs HFS+ \
    -format UDZO -ov "dist/Phasewise-$version.dmg"
echo "dist/Phasewise-$version.dmg"
