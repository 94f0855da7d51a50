"""Images from users, checked: whatever a prompt carries (a PIL image, a numpy array, bytes, a ``data:`` URI, a
local file, an http(s) URL) becomes one fully decoded RGB ``PIL.Image.Image``, or a ``BadRequestError`` that names
the field, the value (shortened) and what is allowed.

Every image comes from someone else, so nothing is trusted: local files are read only under one directory
(resolved, so ``..`` and symlinks cannot leave it), URLs are fetched only from listed hosts (redirects too), the
encoded size is capped before and while reading, the pixel count is checked from the header before anything is
decoded (decompression bombs), only the listed formats' decoders ever see the bytes, and the decode is forced
inside the check so a truncated file is refused here rather than half-read later. Nothing global is changed
(``ImageFile.LOAD_TRUNCATED_IMAGES``, ``Image.MAX_IMAGE_PIXELS``, warning filters), so it is safe in any thread.

``image_hash`` names an image by its pixels, whatever it came from: the key of the encoder cache and of the
prefix cache.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import io
import os
import re
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from ember.config.checks import Rule, check, integer, number
from ember.errors import BadRequestError, ConfigError

DEFAULT_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_CHUNK = 64 * 1024  # a download is read this much at a time, and stopped as soon as it passes the cap
_MAX_PATH = 4096
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")
_WIDE_MODES = ("I", "I;16", "I;16L", "I;16B", "I;16N")  # 16-bit grey (PNG): scaled to 8 bits, not clipped
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")  # two letters at least: "C:\..." is a path
_DATA_URI = re.compile(r"^data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<data>.*)$", re.DOTALL | re.IGNORECASE)
_WHITESPACE = re.compile(rb"[ \t\r\n]+")


def _str_tuple(value: Any) -> bool:
    return isinstance(value, tuple) and all(isinstance(v, str) and v for v in value)


_RULES = {
    "allowed_local_media_path": Rule(lambda v: v is None or (isinstance(v, str) and os.path.isdir(v)),
                                     "an existing directory, or None (no local files)"),
    "allowed_media_domains": Rule(lambda v: v is None or _str_tuple(v),
                                  "a tuple of host names (e.g. ('upload.wikimedia.org',)), or None (no URLs)"),
    "max_image_bytes": integer(1),
    "max_image_pixels": integer(1),
    "fetch_timeout_s": number(0, low_open=True, what="a number of seconds"),
    "formats": Rule(lambda v: _str_tuple(v) and len(v) > 0, "a non-empty tuple of PIL format names"),
}


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """What ``load_image`` may read, and how much: a server setting (vLLM's ``--allowed-local-media-path`` and
    ``--allowed-media-domains``), closed by default, so a request can reach no file and no host unless the operator
    named it. Refused settings raise ``ConfigError`` here, before the model loads."""

    allowed_local_media_path: str | None = None  # local files only under this directory; None: none at all
    allowed_media_domains: tuple[str, ...] | None = None  # http(s) hosts, matched exactly; None: no URLs
    max_image_bytes: int = 20 * 1024 * 1024  # encoded size; also where a download is stopped
    max_image_pixels: int = 40_000_000  # width * height, read from the header before decoding
    fetch_timeout_s: float = 10.0  # each wait on the socket, and the whole download
    formats: tuple[str, ...] = DEFAULT_FORMATS  # PIL format names whose decoders may run

    def __post_init__(self) -> None:
        # lists are taken as tuples (the record stays hashable); host names and formats are matched case-blind
        for name in ("allowed_media_domains", "formats"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        check(self, _RULES)
        if self.allowed_media_domains is not None:
            object.__setattr__(self, "allowed_media_domains",
                               tuple(d.lower().rstrip(".") for d in self.allowed_media_domains))
        formats = tuple(f.upper() for f in self.formats)
        Image.init()
        unknown = [f for f in formats if f not in Image.OPEN]
        if unknown:
            raise ConfigError(f"formats={self.formats!r} is not supported: {unknown[0]!r} is not a format this PIL "
                              f"can open; use names from {sorted(Image.OPEN)}")
        object.__setattr__(self, "formats", formats)


def load_image(source: Any, field: str, policy: MediaPolicy | None = None) -> Image.Image:
    """``source`` as a fully decoded RGB image (a new object: the caller's image is never changed), or a
    ``BadRequestError`` naming ``field``. Sources: a PIL image; a numpy array (HxWx3 or HxW, uint8, or float in
    [0, 1]); bytes; a ``data:image/...;base64,`` URI; a ``file://`` URL or a path (relative ones are taken under
    ``policy.allowed_local_media_path``); an http(s) URL. Animated images give their first frame; transparent
    pixels are laid over white (as vLLM does). A PIL image or an array is the caller's own, already decoded: only
    its size is checked (``policy.formats`` is about which decoders see bytes from outside). No policy: the
    defaults (made here, not at import: checking its formats loads every PIL plugin, 15 ms of start-up)."""
    policy = policy if policy is not None else MediaPolicy()
    if isinstance(source, Image.Image):
        return _finish(source, field, _describe(source), policy)
    if isinstance(source, np.ndarray):
        return _finish(_from_array(source, field, policy), field, _describe(source), policy)
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        _check_bytes(len(data), field, _describe(source), policy)
        return _decode(data, field, _describe(source), policy)
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
        if isinstance(source, bytes):
            source = os.fsdecode(source)
    if isinstance(source, str):
        return _load_str(source, field, policy)
    raise BadRequestError(f"{field} of type {type(source).__name__} is not supported: pass a PIL image, a numpy array "
                          "(HxWx3 or HxW; uint8, or float in [0, 1]), bytes, a data:image/...;base64 URI, a file path "
                          "or file:// URL, or an http(s) URL")


def image_hash(image: Image.Image) -> str:
    """A content hash of an image (blake2b-256 of its mode, size and raw pixel bytes, hex): the same for the same
    pixels whatever they were read from, different for any other pixels; the encoder cache's and the prefix cache's
    key. Give it what ``load_image`` returned (RGB), so that equal pictures share one key."""
    h = hashlib.blake2b(digest_size=32, person=b"ember.image")
    h.update(f"{image.mode}\0{image.width}x{image.height}\0".encode())
    h.update(image.tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------- describing


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else f"{text[:limit - 3]}...({len(text)} chars)"


def _describe(source: Any) -> str:
    """The value as an error message shows it: short, never the whole payload."""
    if isinstance(source, Image.Image):
        return f"<PIL image {source.mode} {source.width}x{source.height}>"
    if isinstance(source, np.ndarray):
        return f"<array shape {source.shape} dtype {source.dtype}>"
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"<{len(source) if not isinstance(source, memoryview) else source.nbytes} bytes>"
    return repr(_short(str(source)))


# ---------------------------------------------------------------------------------------------------- strings


def _load_str(source: str, field: str, policy: MediaPolicy) -> Image.Image:
    shown = _describe(source)
    if not source:
        raise BadRequestError(f"{field}='' is empty: pass an image, a data: URI, a path or a URL")
    scheme = _SCHEME.match(source)
    kind = scheme.group(1).lower() if scheme else None
    if kind == "data":
        return _decode(_data_uri(source, field, shown, policy), field, shown, policy)
    if kind in ("http", "https"):
        return _decode(_fetch(source, field, shown, policy), field, shown, policy)
    if kind == "file":
        parsed = urllib.parse.urlparse(source)
        if parsed.netloc not in ("", "localhost"):
            raise BadRequestError(f"{field}={shown} is not supported: a file:// URL must name a local file "
                                  f"(host '' or 'localhost', not {parsed.netloc!r})")
        return _decode(_read_local(urllib.request.url2pathname(parsed.path), field, shown, policy), field, shown,
                       policy)
    if kind is not None:
        raise BadRequestError(f"{field}={shown} is not supported: URL scheme {kind!r} is not one of data:, file:, "
                              "http:, https:")
    return _decode(_read_local(source, field, shown, policy), field, shown, policy)


def _data_uri(uri: str, field: str, shown: str, policy: MediaPolicy) -> bytes:
    if len(uri) > 2 * (policy.max_image_bytes // 3 * 4) + 4096:  # far too long (wrapped lines allowed): no parsing
        raise BadRequestError(f"{field}={shown} is out of range: a data URI of {len(uri)} characters cannot hold an "
                              f"image of at most max_image_bytes={policy.max_image_bytes}")
    m = _DATA_URI.match(uri)
    if m is None:
        raise BadRequestError(f"{field}={shown} is not a data URI: it must be data:image/<type>;base64,<data>")
    mime, params = m.group("mime").strip().lower(), [p.strip().lower() for p in m.group("params").split(";")[1:]]
    if not mime.startswith("image/") or "base64" not in params:
        raise BadRequestError(f"{field}={shown} is not supported: a data URI must be data:image/<type>;base64,<data> "
                              f"(got media type {mime or 'none'!r}{', not base64' if 'base64' not in params else ''})")
    try:
        payload = _WHITESPACE.sub(b"", m.group("data").encode("ascii"))
    except UnicodeEncodeError:
        raise BadRequestError(f"{field}={shown} is not valid base64: it has non-ASCII characters") from None
    _check_bytes(len(payload) // 4 * 3, field, shown, policy)  # before decoding: the size it would decode to
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadRequestError(f"{field}={shown} is not valid base64: {e}") from None


def _check_bytes(size: int, field: str, shown: str, policy: MediaPolicy) -> None:
    if size > policy.max_image_bytes:
        raise BadRequestError(f"{field}={shown} is {size} bytes, which is out of range: an encoded image must be at "
                              f"most max_image_bytes={policy.max_image_bytes}")


# ---------------------------------------------------------------------------------------------------- local files


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([root, path]) == root


def _read_local(path: str, field: str, shown: str, policy: MediaPolicy) -> bytes:
    """The file's bytes, if it resolves (``..`` and every symlink followed) to a regular file under the allowed
    directory, checked again on the opened descriptor where /proc shows it (a symlink swapped in meanwhile)."""
    if policy.allowed_local_media_path is None:
        raise BadRequestError(f"{field}={shown} is not supported: local files are not allowed (the server's "
                              "allowed_local_media_path, vLLM's --allowed-local-media-path, is not set)")
    if len(path) > _MAX_PATH or "\0" in path:
        raise BadRequestError(f"{field}={shown} is not a usable path: it is longer than {_MAX_PATH} characters or "
                              "has a NUL character")
    root = os.path.realpath(policy.allowed_local_media_path)
    target = os.path.realpath(os.path.join(root, path))  # an absolute path stays itself
    # the folder itself is not named: the message goes to HTTP clients, who learn nothing of the server's files
    outside = BadRequestError(f"{field}={shown} is not supported: it is outside allowed_local_media_path=(the "
                              "server's image folder; give a path relative to it)")
    if not _inside(target, root):
        raise outside
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(target, flags)
    except OSError as e:
        raise BadRequestError(f"{field}={shown} is not a readable file: {e.strerror}") from None
    try:
        proc = f"/proc/self/fd/{fd}"
        if os.path.islink(proc) and not _inside(os.path.realpath(os.readlink(proc)), root):
            raise outside
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BadRequestError(f"{field}={shown} is not supported: it is not a regular file")
        _check_bytes(info.st_size, field, shown, policy)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(policy.max_image_bytes + 1)
    except OSError as e:
        raise BadRequestError(f"{field}={shown} is not a readable file: {e.strerror or e}") from None
    finally:
        os.close(fd)
    _check_bytes(len(data), field, shown, policy)  # grown since fstat
    return data


# ---------------------------------------------------------------------------------------------------- URLs


class _SameHostRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to the same host (and never from https down to http): an allowed host must not
    become a way to reach any other."""

    def __init__(self, host: str, scheme: str, field: str, shown: str):
        super().__init__()
        self.host, self.scheme, self.field, self.shown = host, scheme, field, shown

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> urllib.request.Request | None:
        try:
            new = urllib.parse.urlparse(urllib.parse.urljoin(req.full_url, newurl))
            host, scheme = _host(new), new.scheme.lower()
        except ValueError:  # not a URL: refused like any other place
            host, scheme = None, ""
        if host != self.host or scheme not in ("http", "https") or (self.scheme == "https" and scheme == "http"):
            fp.close()
            raise BadRequestError(f"{self.field}={self.shown} is not supported: it redirects to "
                                  f"{_short(newurl)!r}; a redirect must stay on {self.scheme}://{self.host}")
        fp.close()  # urllib would read the redirect's whole body (no cap): it is not needed
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _host(parsed: urllib.parse.ParseResult) -> str:
    return (parsed.hostname or "").lower().rstrip(".")


def _fetch(url: str, field: str, shown: str, policy: MediaPolicy) -> bytes:
    """The body at ``url``, if its host is allowed: the declared length checked first, then read in chunks and
    stopped as soon as it passes ``max_image_bytes``; ``fetch_timeout_s`` bounds each socket wait and, checked
    between chunks, the whole download."""
    if policy.allowed_media_domains is None:
        raise BadRequestError(f"{field}={shown} is not supported: fetching URLs is not allowed (the server's "
                              "allowed_media_domains, vLLM's --allowed-media-domains, is not set)")
    try:
        parsed = urllib.parse.urlparse(url)
        host = _host(parsed)
    except ValueError as e:
        raise BadRequestError(f"{field}={shown} is not a valid URL: {e}") from None
    if host not in policy.allowed_media_domains:
        raise BadRequestError(f"{field}={shown} is not supported: host {host!r} is not in allowed_media_domains "
                              f"{list(policy.allowed_media_domains)}")
    opener = urllib.request.build_opener(_SameHostRedirects(host, parsed.scheme.lower(), field, shown))
    request = urllib.request.Request(url, headers={"User-Agent": "ember", "Accept": "image/*"})
    deadline = time.monotonic() + policy.fetch_timeout_s
    chunks: list[bytes] = []
    total = 0
    try:
        with opener.open(request, timeout=policy.fetch_timeout_s) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.strip().isdigit():
                _check_bytes(int(length), field, shown, policy)
            read = getattr(response, "read1", response.read)  # read1: one socket read, never waits for a full chunk
            while chunk := read(_CHUNK):
                chunks.append(chunk)
                total += len(chunk)
                if total > policy.max_image_bytes:
                    raise BadRequestError(f"{field}={shown} is larger than max_image_bytes={policy.max_image_bytes}: "
                                          f"the download was stopped after {total} bytes")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the download took longer than fetch_timeout_s={policy.fetch_timeout_s}")
    except BadRequestError:
        raise
    except urllib.error.HTTPError as e:
        e.close()
        raise BadRequestError(f"{field}={shown} could not be fetched: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise BadRequestError(f"{field}={shown} could not be fetched: {e.reason}") from None
    except TimeoutError as e:
        raise BadRequestError(f"{field}={shown} could not be fetched: {e or 'timed out'} (fetch_timeout_s="
                              f"{policy.fetch_timeout_s})") from None
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise BadRequestError(f"{field}={shown} could not be fetched: {type(e).__name__}: {e}") from None
    return b"".join(chunks)


# ---------------------------------------------------------------------------------------------------- decoding

# leading bytes of formats a policy may leave out, so that a refusal names the format without running its decoder
_MAGIC = [(b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"),
          (b"GIF87a", "GIF"), (b"GIF89a", "GIF"), (b"BM", "BMP"), (b"\x00\x00\x01\x00", "ICO"), (b"8BPS", "PSD"),
          (b"%PDF", "PDF"), (b"\x00\x00\x00\x0cjP  ", "JPEG2000"), (b"\xffO\xffQ", "JPEG2000"), (b"qoif", "QOI"),
          (b"%!PS", "EPS"), (b"\xc5\xd0\xd3\xc6", "EPS"), (b"DDS ", "DDS"), (b"icns", "ICNS")]


def _sniff(data: bytes) -> str | None:
    """The format the bytes look like, by their first bytes only (nothing is decoded), or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[4:8] == b"ftyp":
        brand = data[8:12]
        return "AVIF" if brand in (b"avif", b"avis") else "HEIF" if brand[:3] in (b"hei", b"hev", b"mif") else None
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return name
    head = data[:1024].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if head.startswith((b"<?xml", b"<svg", b"<!doctype svg")) and b"<svg" in head:
        return "SVG"
    return None


def _decode(data: bytes, field: str, shown: str, policy: MediaPolicy) -> Image.Image:
    """Only the allowed formats' decoders see the bytes; the size is checked from the header, then decoded."""
    if not data:
        raise BadRequestError(f"{field}={shown} is not a readable image: it is empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data), formats=policy.formats)
    except Image.UnidentifiedImageError:
        sniffed = _sniff(data)
        if sniffed is not None and sniffed not in policy.formats:
            raise BadRequestError(f"{field}={shown} is in format {sniffed}, which is not supported: use one of "
                                  f"{', '.join(policy.formats)}") from None
        raise BadRequestError(f"{field}={shown} is not a readable image: cannot identify the image data (allowed "
                              f"formats: {', '.join(policy.formats)})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _too_many_pixels(field, shown, str(e), policy) from None
    except Exception as e:  # a header PIL cannot parse: its plugins raise many kinds (SyntaxError, struct.error, ...)
        raise BadRequestError(f"{field}={shown} is not a readable image: {_reason(e)}") from None
    fmt = "JPEG" if image.format == "MPO" else image.format  # MPO: a camera's JPEG with extra frames
    if fmt not in policy.formats:
        raise BadRequestError(f"{field}={shown} is in format {image.format}, which is not supported: use one of "
                              f"{', '.join(policy.formats)}")
    return _finish(image, field, shown, policy)


def _too_many_pixels(field: str, shown: str, what: str, policy: MediaPolicy) -> BadRequestError:
    return BadRequestError(f"{field}={shown} is {what}, which is out of range: an image must have at most "
                           f"max_image_pixels={policy.max_image_pixels} pixels (width * height)")


def _reason(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return _short(text.split(" <_io.", 1)[0], 200)  # PIL names the BytesIO object: nothing a user can use


def _check_size(width: int, height: int, field: str, shown: str, policy: MediaPolicy) -> None:
    if width <= 0 or height <= 0:
        raise BadRequestError(f"{field}={shown} is {width}x{height}, which is out of range: an image must have at "
                              "least one pixel")
    if width * height > policy.max_image_pixels:
        raise _too_many_pixels(field, shown, f"{width}x{height} = {width * height} pixels", policy)


def _finish(image: Image.Image, field: str, shown: str, policy: MediaPolicy) -> Image.Image:
    """Size checked (from the header: nothing decoded yet), then the frame decoded in full and made RGB (the first
    frame of a file; a PIL image given by the caller keeps the frame it is at)."""
    _check_size(image.width, image.height, field, shown, policy)
    try:
        image.load()  # the whole decode, here: a truncated or corrupt file fails now, not in the model
        return _to_rgb(image)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _too_many_pixels(field, shown, str(e), policy) from None
    except MemoryError:
        raise BadRequestError(f"{field}={shown} is not a readable image: out of memory decoding it") from None
    except Exception as e:  # PIL's decoders raise OSError, SyntaxError, ValueError, EOFError, ... on bad data
        raise BadRequestError(f"{field}={shown} is not a readable image: {_reason(e)}") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    """A new RGB image: alpha (and a palette's transparent colour) laid over white, 16-bit grey scaled to 8 bits."""
    if image.mode == "RGB":
        return image.copy()
    if image.mode in _WIDE_MODES:
        grey = np.asarray(image).astype(np.int64)
        return Image.fromarray((np.clip(grey, 0, 65535) >> 8).astype(np.uint8)).convert("RGB")
    if image.mode in _ALPHA_MODES or (image.mode in ("P", "L", "RGB") and "transparency" in image.info):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _from_array(array: np.ndarray, field: str, policy: MediaPolicy) -> Image.Image:
    """Shape, size and dtype checked before any copy; floats in [0, 1] rounded to 8 bits."""
    shown = _describe(array)
    allowed = "an HxWx3 (RGB) or HxW (grey) array of uint8, or of floats in [0, 1]"
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] != 3):
        raise BadRequestError(f"{field}={shown} is not supported: pass {allowed}")
    if array.dtype != np.uint8 and array.dtype.kind != "f":
        raise BadRequestError(f"{field}={shown} is not supported: pass {allowed}")
    _check_size(array.shape[1], array.shape[0], field, shown, policy)
    if array.dtype.kind == "f":
        if not (np.isfinite(array).all() and array.min() >= 0 and array.max() <= 1):
            raise BadRequestError(f"{field}={shown} is out of range: float pixels must be finite and in [0, 1]")
        array = np.rint(array.astype(np.float64) * 255).astype(np.uint8)
    return Image.fromarray(np.ascontiguousarray(array))
