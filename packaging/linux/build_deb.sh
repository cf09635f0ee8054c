#!/usr/bin/env bash
# Wrap the PyInstaller one-folder bundle into a Debian package:
#   /opt/phasewise/             the bundle (read-only; user data goes to the user's dirs)
#   /usr/bin/phasewise          a symlink to the bundle's executable
#   /usr/share/applications/    the .desktop entry
#   /usr/share/icons/hicolor/scalable/apps/phasewise.svg
# Usage: packaging/linux/build_deb.sh BUNDLE_DIR VERSION OUT_DIR
set -euo pipefail

bundle=$1 version=$2 out=$3
root=$(cd "$(dirname "$0")/../.." && pwd)
stage=$(mktemp -d "${TMPDIR:-/tmp}/phasewise-deb.XXXXXX")
trap 'rm -rf "$stage"' EXIT

install -d "$stage/DEBIAN" "$stage/opt" "$stage/usr/bin" \
    "$stage/usr/share/applications" "$stage/usr/share/icons/hicolor/scalable/apps"
# cp -a keeps the bundle's symlinks and permissions; root ownership comes from --root-owner-group.
cp -a "$bundle" "$stage/opt/phasewise"
ln -s /opt/phasewise/phasewise "$stage/usr/bin/phasewise"
install -m 644 "$root/packaging/linux/phasewise.desktop" "$stage/usr/share/applications/"
install -m 644 "$root/assets/phasewise.svg" "$stage/usr/share/icons/hicolor/scalable/apps/"
# Read-only for everyone except root, whatever the build machine's umask was.
chmod -R u+rwX,go+rX,go-w "$stage/opt/phasewise"

installed_kb=$(du -sk "$stage" | cut -f1)
# The bundle carries its own Python, Qt and torch; the system provides libc, OpenGL/EGL, fonts
# and the X11/xcb client libraries Qt's xcb platform plugin loads (PyInstaller leaves those out).
cat > "$stage/DEBIAN/control" <<CONTROL
Package: phasewise
Version: $version
Architecture: amd64
Maintainer: Phasewise developers <phasewise@localhost>
Installed-Size: $installed_kb
Depends: libc6 (>= 2.28), libgl1, libegl1, libfontconfig1, libfreetype6, libxkbcommon0, libxkbcommon-x11-0, libxcb-cursor0, libxcb-icccm4, libxcb-keysyms1, libxcb-shape0, libx11-xcb1, libdbus-1-3
Section: science
Priority: optional
Description: chat with local language models and see where the time goes
 Phasewise streams a local model's answer and shows time to first token,
 inter-token latency and throughput, split into queue, prefill and decode.
 It runs offline on a bundled default model (SmolLM2-135M-Instruct, CPU).
CONTROL

mkdir -p "$out"
deb="$out/phasewise_${version}_amd64.deb"
# gzip: much faster than the default xz on a 2-core CI machine for a few % more size.
dpkg-deb --root-owner-group -Zgzip -z6 --build "$stage" "$deb" >/dev/null
echo "$deb"
