; Inno Setup script: a per-user installer around the PyInstaller one-folder bundle.
; Build on Windows (see packaging/README.md):
;   pyinstaller --noconfirm --distpath build\dist --workpath build\pyinstaller packaging\phasewise.spec
;   iscc /DAppVersion=0.1.0 packaging\windows\phasewise.iss
; Output: dist\phasewise-<version>-setup.exe
; The bundle is read-only once installed; chats, caches and settings go to the user's
; AppData folders (platformdirs / QSettings), never under {app}.

#ifndef AppVersion
  #error Pass the version from pyproject.toml: iscc /DAppVersion=X.Y.Z phasewise.iss
#endif

[Setup]
AppId={{6C1B7A52-3F0E-4E8B-9D3A-2B1F4C7E9A10}
AppName=Phasewise
AppVersion={#AppVersion}
AppVerName=Phasewise {#AppVersion}
DefaultDirName={autopf}\Phasewise
DefaultGroupName=Phasewise
DisableProgramGroupPage=yes
; Per-user install by default (no admin prompt); the user may choose all users.
PrivilegesRequired=lowest
PrivilegesRequiredOverridesAllowed=dialog
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
OutputDir=..\..\dist
OutputBaseFilename=phasewise-{#AppVersion}-setup
; The model and torch are already dense; fast LZMA2 keeps the build short.
Compression=lzma2/fast
SolidCompression=yes
WizardStyle=modern
UninstallDisplayIcon={app}\phasewise.exe

[Files]
Source: "..\..\build\dist\phasewise\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{autoprograms}\Phasewise"; Filename: "{app}\phasewise.exe"
Name: "{autodesktop}\Phasewise"; Filename: "{app}\phasewise.exe"; Tasks: desktopicon

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked

[Run]
Filename: "{app}\phasewise.exe"; Description: "{cm:LaunchProgram,Phasewise}"; Flags: nowait postinstall skipifsilent
