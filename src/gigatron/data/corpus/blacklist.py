"""URL filtering: documents dropped by domain list, file extension, short, malformed or
repeated URL (the checks of Megatron's OpenWebText URL step, over JSON lines or URL lists)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

# Media, archive, binary and code files: their URLs hold no prose to train on.
DEFAULT_EXTENSIONS = tuple(
    """
    .3gp .7z .ai .aif .apk .app .avi .bin .bmp .bz2 .css .csv .dat .deb .dmg .doc .docx .exe .gif
    .gifv .gz .iso .jar .jpeg .jpg .js .log .mid .midi .mkv .mov .mp3 .mp4 .mpeg .mpg .ogg .ogv
    .otf .pdf .pkg .png .pps .ppt .pptx .psd .py .qt .ram .rar .sql .svg .swf .tar .tar.gz .tgz
    .tiff .ttf .txt .wav .webm .wma .wmv .xls .xlsx .xml .xz .zip
    """.split()
)
MIN_URL_CHARS = 9
_URL = re.compile(r"^(?:https?|ftp)://[^\s/$.?#][^\s]*$", re.I)


def read_domains(lines: list[str]) -> frozenset[str]:
    """Domains of a list file: one per line, `#` comments and blank lines ignored."""
    domains = (line.split("#", 1)[0].strip().lower() for line in lines)
    return frozenset(domain.lstrip(".") for domain in domains if domain)


def host_is_listed(host: str, domains: frozenset[str]) -> bool:
    """True when `host` is a listed domain or a subdomain of one."""
    parts = host.lower().split(".")
    return any(".".join(parts[i:]) in domains for i in range(len(parts)))


class URLFilter:
    """Drop reasons of URLs: domain, extension, short, malformed, duplicate (first kept)."""

    def __init__(self, domains: frozenset[str], extensions: tuple[str, ...]) -> None:
        self.domains = domains
        self.extensions = tuple(ext.lower() for ext in extensions)
        self.seen: set[str] = set()

    def reason(self, url: str) -> str:
        url = url.strip()
        if len(url) < MIN_URL_CHARS:
            return "short_url"
        if not _URL.match(url):
            return "malformed_url"
        parts = urlsplit(url)
        if host_is_listed(parts.hostname or "", self.domains):
            return "domain"
        if parts.path.lower().endswith(self.extensions):
            return "extension"
        if url in self.seen:
            return "duplicate_url"
        self.seen.add(url)
        return "kept"
