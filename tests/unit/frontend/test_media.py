"""ember.frontend.media: every kind of image source a prompt may carry becomes the same checked RGB image (and the
same hash), and every unsafe or broken one is refused with a BadRequestError naming the field: formats, truncated
data, decompression bombs, paths outside the allowed directory, hosts outside the allowed list, redirects, oversized
downloads. No network: URLs go to a local http.server on 127.0.0.1."""

from __future__ import annotations

import base64
import dataclasses
import http.server
import io
import os
import struct
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile

from ember.errors import BadRequestError, ConfigError
from ember.frontend.media import MediaPolicy, image_hash, load_image

FIELD = "messages[0].content[1].image_url"


def _pixels(height: int = 5, width: int = 7, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def _data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _png_header(width: int, height: int, idat: bytes = zlib.compress(b"\0" * 16)) -> bytes:
    """A valid PNG signature, IHDR (8-bit RGB, declaring width x height), one small IDAT and IEND: what a
    decompression bomb looks like before its pixels are decoded."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _refused(source, match: str, policy: MediaPolicy = MediaPolicy()) -> BadRequestError:
    with pytest.raises(BadRequestError, match=match) as info:
        load_image(source, FIELD, policy)
    assert str(info.value).startswith(FIELD), str(info.value)  # the field comes first, as elsewhere in ember
    return info.value


# ------------------------------------------------------------------------------------------------- a local server


class _Server:
    """A local HTTP server: routes path -> (status, headers, body or a callable writing the body)."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple] = {}
        self.hits: list[str] = []
        self.sent: dict[str, int] = {}
        self.done: dict[str, threading.Event] = {}
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                server.hits.append(self.path)
                status, headers, body = server.routes.get(self.path, (404, {}, b"no such image"))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v.replace("{port}", str(server.port)))
                if not callable(body):
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    if callable(body):
                        body(self, server)
                    else:
                        self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    server.done.setdefault(self.path, threading.Event()).set()

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


def _endless(total: int):
    def write(handler, server) -> None:
        chunk, sent = b"\0" * 65536, 0
        try:
            while sent < total:
                handler.wfile.write(chunk)
                sent += len(chunk)
        finally:
            server.sent[handler.path] = sent
    return write


def _drip(handler, server) -> None:
    for _ in range(200):  # a byte every 0.05 s: each read succeeds, the whole never ends in time
        handler.wfile.write(b"\0")
        handler.wfile.flush()
        time.sleep(0.05)


def _slow(handler, server) -> None:
    time.sleep(2)
    handler.wfile.write(b"late")


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("no_proxy", "*")


@pytest.fixture(scope="module")
def server():
    s = _Server()
    png = _encode(Image.fromarray(_pixels()), "PNG")
    s.routes.update({
        "/img.png": (200, {"Content-Type": "image/png"}, png),
        "/same-host": (302, {"Location": "/img.png"}, b""),
        "/same-host-endless": (302, {"Location": "/img.png"}, _endless(64 * 1024 * 1024)),
        "/other-host": (302, {"Location": "http://localhost:{port}/img.png"}, b""),
        "/to-file": (302, {"Location": "file:///etc/passwd"}, b""),
        "/declared-big": (200, {"Content-Length": str(50 * 1024 * 1024)}, lambda h, s: h.wfile.write(b"\0" * 10)),
        "/endless": (200, {}, _endless(64 * 1024 * 1024)),
        "/drip": (200, {}, _drip),
        "/slow": (200, {}, _slow),
    })
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


@pytest.fixture
def allowed(tmp_path) -> Path:
    """tmp/allowed (the allowed directory, with img.png) and tmp/outside/secret.png next to it."""
    (tmp_path / "allowed").mkdir()
    (tmp_path / "outside").mkdir()
    image = Image.fromarray(_pixels())
    image.save(tmp_path / "allowed" / "img.png")
    image.save(tmp_path / "outside" / "secret.png")
    return tmp_path / "allowed"


# ------------------------------------------------------------------------------------------------- loading


def test_every_source_kind_gives_the_same_rgb_pixels_and_hash(allowed, server, monkeypatch):
    pixels = _pixels()
    image = Image.fromarray(pixels)
    png = _encode(image, "PNG")
    policy = MediaPolicy(allowed_local_media_path=str(allowed), allowed_media_domains=("127.0.0.1",))
    monkeypatch.chdir(allowed.parent)  # relative paths are taken under the allowed directory, not the cwd
    sources = {
        "pil": image, "pil-rgba": image.convert("RGBA"), "uint8": pixels, "float": pixels / 255.0,
        "float32": (pixels / 255.0).astype(np.float32), "strided": np.ascontiguousarray(pixels[:, ::-1])[:, ::-1],
        "bytes": png, "bytearray": bytearray(png), "memoryview": memoryview(png), "data-uri": _data_uri(png),
        "data-uri-wrapped": "data:image/png;base64," + "\n".join(base64.encodebytes(png).decode().split()),
        "data-uri-case": "DATA:Image/PNG;BASE64," + base64.b64encode(png).decode(),
        "webp-lossless": _encode(image, "WEBP", lossless=True), "bmp": _encode(image, "BMP"),
        "path": str(allowed / "img.png"), "relative": "img.png", "pathlib": allowed / "img.png",
        "file-url": (allowed / "img.png").as_uri(), "file-localhost": f"file://localhost{allowed / 'img.png'}",
        "http": server.url("/img.png"), "redirect-same-host": server.url("/same-host"),
    }
    want = image_hash(image)
    for name, source in sources.items():
        got = load_image(source, FIELD, policy)
        assert got.mode == "RGB" and got.size == (7, 5), name
        assert np.array_equal(np.asarray(got), pixels), name
        assert image_hash(got) == want, name
    assert image.mode == "RGB" and load_image(image, FIELD) is not image  # a copy: the caller's image is untouched


def test_the_hash_is_of_the_pixels_only():
    pixels = _pixels()
    base = image_hash(Image.fromarray(pixels))
    assert len(base) == 64 and int(base, 16) >= 0
    changed = pixels.copy()
    changed[2, 3, 1] ^= 1
    assert image_hash(Image.fromarray(changed)) != base
    flat = _pixels(1, 35)
    assert flat.tobytes() == pixels.tobytes() and image_hash(Image.fromarray(flat)) != base  # same bytes, other size
    grey = _pixels()[..., 0]
    assert image_hash(load_image(grey, FIELD)) == image_hash(Image.fromarray(np.repeat(grey[..., None], 3, axis=2)))
    jpeg = _encode(Image.fromarray(_pixels(32, 32)), "JPEG")
    assert image_hash(load_image(jpeg, FIELD)) == image_hash(load_image(_data_uri(jpeg, "image/jpeg"), FIELD))


def test_an_animated_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (4, 3), c) for c in ((255, 0, 0), (0, 0, 255))]
    gif = _encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    assert Image.open(io.BytesIO(gif)).n_frames == 2
    got = load_image(gif, FIELD)
    assert got.mode == "RGB" and got.size == (4, 3)
    assert (np.asarray(got) == (255, 0, 0)).all()


def test_transparency_is_laid_over_white_and_16_bit_grey_is_scaled():
    rgba = np.zeros((2, 2, 4), dtype=np.uint8)
    rgba[0, 0] = (10, 20, 30, 255)  # opaque: kept; the rest transparent black: white
    got = np.asarray(load_image(_encode(Image.fromarray(rgba), "PNG"), FIELD))
    assert tuple(got[0, 0]) == (10, 20, 30) and tuple(got[1, 1]) == (255, 255, 255)
    palette = Image.new("P", (2, 1), 0)
    palette.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    palette.putpixel((1, 0), 1)
    got = np.asarray(load_image(_encode(palette, "PNG", transparency=0), FIELD))
    assert tuple(got[0, 0]) == (255, 255, 255) and tuple(got[0, 1]) == (200, 100, 50)
    wide = Image.fromarray(np.array([[0, 32768, 65535]], dtype=np.uint16))
    png16 = _encode(wide, "PNG")
    assert Image.open(io.BytesIO(png16)).mode.startswith("I")
    assert np.asarray(load_image(png16, FIELD))[0, :, 0].tolist() == [0, 128, 255]


def test_a_camera_mpo_counts_as_jpeg():
    frames = [Image.fromarray(_pixels(16, 16, seed)) for seed in (1, 2)]
    mpo = _encode(frames[0], "MPO", save_all=True, append_images=frames[1:])
    assert Image.open(io.BytesIO(mpo)).format == "MPO"
    assert load_image(mpo, FIELD).size == (16, 16)
    _refused(mpo, "in format JPEG, which is not supported", MediaPolicy(formats=("PNG",)))


# ------------------------------------------------------------------------------------------------- bad data


def _truncated_png() -> bytes:
    png = _encode(Image.fromarray(_pixels(64, 64)), "PNG")
    return png[:len(png) // 2]


def _truncated_jpeg() -> bytes:
    jpeg = _encode(Image.fromarray(_pixels(64, 64)), "JPEG", quality=95)
    return jpeg[:len(jpeg) // 2]


@pytest.mark.parametrize("data, match", [
    (_truncated_png(), r"is not a readable image: .*(truncated|broken|incomplete)"),
    (_truncated_jpeg(), r"is not a readable image: .*truncated"),
    (np.random.default_rng(3).bytes(4096), r"is not a readable image: cannot identify"),
    (b"", r"is not a readable image: it is empty"),
    (b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>',
     r"is in format SVG, which is not supported: use one of PNG, JPEG, WEBP, GIF, BMP"),
    (_encode(Image.fromarray(_pixels()), "TIFF"), r"is in format TIFF, which is not supported"),
    (_encode(Image.fromarray(_pixels()), "ICO"), r"is in format ICO, which is not supported"),
    (_png_header(0, 0), r"is not a readable image"),
    (_png_header(4, 4)[:-20] + b"\0" * 8, r"is not a readable image"),  # IDAT's CRC broken, IEND gone
], ids=["truncated-png", "truncated-jpeg", "random", "empty", "svg", "tiff", "ico", "zero-size-png", "bad-crc"])
def test_broken_or_refused_data_is_a_bad_request_naming_the_field(data, match):
    _refused(data, match)
    _refused(_data_uri(data), match)


def test_a_format_left_out_of_the_policy_never_reaches_its_decoder():
    gif = _encode(Image.new("RGB", (3, 3), (1, 2, 3)), "GIF")
    _refused(gif, r"is in format GIF, which is not supported: use one of PNG$", MediaPolicy(formats=("PNG",)))
    assert load_image(_encode(Image.fromarray(_pixels()), "TIFF"), FIELD, MediaPolicy(formats=("tiff",))).size == (7, 5)


def test_decompression_bombs_are_refused_from_the_header_before_decoding():
    start = time.monotonic()
    for source in (_png_header(100_000, 100_000), _data_uri(_png_header(100_000, 100_000))):
        err = _refused(source, r"10000000000 pixels.*out of range.*max_image_pixels=40000000")
        assert "not a readable image" not in str(err)
    # 8000x8000 is under PIL's own limit but over ember's: refused by the size alone (its data would not decode)
    _refused(_png_header(8000, 8000), r"is 8000x8000 = 64000000 pixels, which is out of range: an image must have "
                                      r"at most max_image_pixels=40000000")
    _refused(_pixels(), r"7x5 = 35 pixels, which is out of range.*max_image_pixels=34",
             MediaPolicy(max_image_pixels=34))
    # an array's shape is checked before any copy (a broadcast view: 192 MB if it were copied)
    _refused(np.broadcast_to(np.zeros(3, np.float32), (8000, 8000, 3)), r"8000x8000 = 64000000 pixels")
    _refused(Image.new("L", (9000, 9000)), r"9000x9000 = 81000000 pixels")
    assert time.monotonic() - start < 5
    assert Image.MAX_IMAGE_PIXELS == 89478485 and ImageFile.LOAD_TRUNCATED_IMAGES is False  # nothing global changed


def test_zero_sized_images_are_refused():
    _refused(Image.new("RGB", (0, 3)), r"is 0x3, which is out of range: an image must have at least one pixel")
    _refused(np.zeros((0, 4, 3), dtype=np.uint8), r"is 4x0, which is out of range")


@pytest.mark.parametrize("uri, match", [
    ("data:image/png;base64,iVBOR!!!", r"is not valid base64"),
    ("data:image/png;base64,iVBORw0KGgo", r"is not valid base64"),  # bad padding
    ("data:image/png;base64,ünïcode", r"is not valid base64: it has non-ASCII"),
    ("data:text/plain;base64,aGVsbG8=", r"media type 'text/plain'"),
    ("data:image/png,%89PNG", r"must be data:image/<type>;base64,<data> \(got media type 'image/png', not base64\)"),
    ("data:image/png;base64", r"is not a data URI"),
    ("data:image/png;base64," + "A" * 400, r"is not a readable image"),
])
def test_bad_data_uris_are_refused(uri, match):
    err = _refused(uri, match)
    assert len(str(err)) < 400  # the value is shortened


def test_an_oversized_payload_is_refused_before_decoding():
    policy = MediaPolicy(max_image_bytes=1000)
    png = _encode(Image.fromarray(_pixels(64, 64)), "PNG")
    assert len(png) > 1000
    _refused(png, rf"=<{len(png)} bytes> is {len(png)} bytes, which is out of range: .*max_image_bytes=1000", policy)
    _refused("data:image/png;base64," + "A" * 4000, r"is 3000 bytes, which is out of range", policy)
    _refused("data:image/png;base64," + "A" * 100_000, r"is out of range: a data URI of 100022 characters", policy)


@pytest.mark.parametrize("source, kind", [(3, "int"), (None, "NoneType"), ({"url": "x"}, "dict"), ([1, 2], "list"),
                                          (1.5, "float")])
def test_other_types_are_refused_naming_the_type_and_the_kinds(source, kind):
    _refused(source, rf"of type {kind} is not supported: pass a PIL image, a numpy array .*bytes, a data:image.* "
                     r"URI, a file path or file:// URL, or an http\(s\) URL")


@pytest.mark.parametrize("array, match", [
    (np.zeros((4, 4, 4), np.uint8), r"shape \(4, 4, 4\) dtype uint8> is not supported: pass an HxWx3"),
    (np.zeros((4, 4, 1), np.uint8), r"is not supported"),
    (np.zeros((2, 4, 4, 3), np.uint8), r"is not supported"),
    (np.zeros(12, np.uint8), r"is not supported"),
    (np.zeros((4, 4, 3), np.int64), r"dtype int64> is not supported"),
    (np.zeros((4, 4), bool), r"dtype bool> is not supported"),
    (np.full((4, 4, 3), 1.5), r"is out of range: float pixels must be finite and in \[0, 1\]"),
    (np.full((4, 4), -0.1, np.float32), r"is out of range"),
    (np.full((4, 4, 3), np.nan), r"is out of range"),
])
def test_arrays_of_other_shapes_and_dtypes_are_refused(array, match):
    _refused(array, match)


# ------------------------------------------------------------------------------------------------- local files


def test_local_files_are_refused_without_an_allowed_path(allowed):
    for source in (str(allowed / "img.png"), allowed / "img.png", (allowed / "img.png").as_uri(), "img.png"):
        _refused(source, r"is not supported: local files are not allowed .*allowed_local_media_path")


def test_paths_cannot_leave_the_allowed_directory(allowed):
    policy = MediaPolicy(allowed_local_media_path=str(allowed))
    secret = allowed.parent / "outside" / "secret.png"
    (allowed / "sub").mkdir()
    os.symlink(secret, allowed / "link-out.png")
    os.symlink(allowed.parent / "outside", allowed / "sub" / "dir-out")
    os.symlink(allowed / "img.png", allowed / "sub" / "link-in.png")
    outside = r"is not supported: it is outside allowed_local_media_path="
    for source in ("../outside/secret.png", str(allowed / ".." / "outside" / "secret.png"), str(secret),
                   "sub/../../outside/secret.png", "link-out.png", "sub/dir-out/secret.png", secret.as_uri(),
                   (allowed / "link-out.png").as_uri(), "/etc/passwd", "../outside/missing.png", "..", "/"):
        _refused(source, outside, policy)
    assert load_image("sub/link-in.png", FIELD, policy).size == (7, 5)  # a link that stays inside is fine
    assert load_image("sub/../img.png", FIELD, policy).size == (7, 5)
    _refused(f"file://otherhost{secret}", r"a file:// URL must name a local file", policy)


def test_the_allowed_directory_may_itself_be_a_symlink(allowed, tmp_path):
    os.symlink(allowed, tmp_path / "link-to-allowed")
    policy = MediaPolicy(allowed_local_media_path=str(tmp_path / "link-to-allowed"))
    assert load_image("img.png", FIELD, policy).size == (7, 5)
    _refused("../outside/secret.png", "is outside", policy)


def test_only_existing_regular_files_of_allowed_size_are_read(allowed):
    policy = MediaPolicy(allowed_local_media_path=str(allowed))
    _refused("missing.png", r"is not a readable file: No such file", policy)
    (allowed / "dir").mkdir()
    _refused("dir", r"is not supported: it is not a regular file", policy)
    os.mkfifo(allowed / "fifo")  # opening a FIFO for reading would wait for a writer: refused without waiting
    _refused("fifo", r"is not supported: it is not a regular file", policy)
    size = (allowed / "img.png").stat().st_size
    _refused("img.png", rf"is {size} bytes, which is out of range", dataclasses.replace(policy, max_image_bytes=10))
    _refused("sub\0dir/img.png", r"has a NUL character", policy)


# ------------------------------------------------------------------------------------------------- URLs


def test_urls_are_refused_without_allowed_domains(server):
    before = len(server.hits)
    _refused(server.url("/img.png"), r"is not supported: fetching URLs is not allowed .*allowed_media_domains")
    assert len(server.hits) == before  # nothing was requested


def test_only_allowed_hosts_are_fetched(server):
    policy = MediaPolicy(allowed_media_domains=("127.0.0.1",))
    before = len(server.hits)
    _refused(server.url("/img.png", "localhost"), r"host 'localhost' is not in allowed_media_domains \['127.0.0.1'\]",
             policy)
    _refused(f"http://127.0.0.1@localhost:{server.port}/img.png", r"host 'localhost' is not in", policy)
    _refused(f"ftp://127.0.0.1:{server.port}/img.png", r"URL scheme 'ftp' is not one of data:, file:, http:, https:",
             policy)
    assert len(server.hits) == before
    assert load_image(server.url("/img.png").upper().replace("/IMG.PNG", "/img.png"), FIELD, policy).size == (7, 5)


def test_a_redirect_to_another_host_is_refused(server):
    both = MediaPolicy(allowed_media_domains=("127.0.0.1", "localhost"))
    before = len(server.hits)
    _refused(server.url("/other-host"), r"it redirects to 'http://localhost:\d+/img.png'; a redirect must stay on "
                                        r"http://127.0.0.1", both)  # even to another allowed host
    _refused(server.url("/to-file"), r"file:///etc/passwd.*(is not allowed|must stay)", both)
    assert server.hits[before:] == ["/other-host", "/to-file"]  # the redirect's target was never requested
    # a redirect that is followed: its own body is not read (urllib would read all of it, with no cap)
    assert load_image(server.url("/same-host-endless"), FIELD, both).size == (7, 5)
    assert server.done.setdefault("/same-host-endless", threading.Event()).wait(10)
    assert server.sent["/same-host-endless"] < 32 * 1024 * 1024


def test_downloads_past_max_image_bytes_are_stopped(server):
    policy = MediaPolicy(allowed_media_domains=("127.0.0.1",), max_image_bytes=256 * 1024)
    start = time.monotonic()
    _refused(server.url("/declared-big"), r"is 52428800 bytes, which is out of range", policy)
    err = _refused(server.url("/endless"), r"is larger than max_image_bytes=262144: the download was stopped after",
                   policy)
    stopped_at = int(str(err).rsplit("after ", 1)[1].split()[0])
    assert 256 * 1024 < stopped_at <= 256 * 1024 + 65536
    assert server.done.setdefault("/endless", threading.Event()).wait(10)
    assert server.sent["/endless"] < 32 * 1024 * 1024  # the server was cut off long before its 64 MiB
    assert time.monotonic() - start < 10


def test_fetches_are_bounded_in_time(server):
    policy = MediaPolicy(allowed_media_domains=("127.0.0.1",), fetch_timeout_s=0.3)
    for path in ("/slow", "/drip"):  # no answer in time; an answer that never ends in time
        start = time.monotonic()
        _refused(server.url(path), r"could not be fetched: .*(timed out|longer than fetch_timeout_s=0.3)", policy)
        assert time.monotonic() - start < 1.5, path
    _refused(server.url("/missing"), r"could not be fetched: HTTP 404", policy)
    _refused(f"http://127.0.0.1:{_free_port()}/img.png", r"could not be fetched: .*refused", policy)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------- the policy


def test_policy_settings_are_checked_before_use(tmp_path):
    with pytest.raises(ConfigError, match=r"allowed_media_domains='example.com' is out of range: it must be a tuple"):
        MediaPolicy(allowed_media_domains="example.com")
    with pytest.raises(ConfigError, match=r"allowed_local_media_path=.* is out of range: it must be an existing dir"):
        MediaPolicy(allowed_local_media_path=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"max_image_bytes=0 is out of range"):
        MediaPolicy(max_image_bytes=0)
    with pytest.raises(ConfigError, match=r"max_image_pixels=True is out of range"):
        MediaPolicy(max_image_pixels=True)
    with pytest.raises(ConfigError, match=r"fetch_timeout_s=0 is out of range"):
        MediaPolicy(fetch_timeout_s=0)
    with pytest.raises(ConfigError, match=r"formats=\('PNG', 'NOPE'\) is not supported: 'NOPE' is not a format"):
        MediaPolicy(formats=("PNG", "NOPE"))
    with pytest.raises(ConfigError, match=r"formats=\(\) is out of range"):
        MediaPolicy(formats=())
    policy = MediaPolicy(allowed_media_domains=["Example.COM."], formats=["png", "jpeg"])
    assert policy.allowed_media_domains == ("example.com",) and policy.formats == ("PNG", "JPEG")
    assert hash(policy) == hash(MediaPolicy(allowed_media_domains=("example.com",), formats=("PNG", "JPEG")))
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.max_image_bytes = 1


# ------------------------------------------------------------------------------------------------- fuzz

_SEEDS = [_encode(Image.fromarray(_pixels(12, 9, 5)), fmt, **kw) for fmt, kw in
          [("PNG", {}), ("JPEG", {}), ("GIF", {}), ("WEBP", {}), ("BMP", {}), ("WEBP", {"lossless": True})]]
_FUZZ_POLICY = MediaPolicy(max_image_pixels=4_000_000)


@st.composite
def _mutated(draw) -> bytes:
    data = bytearray(draw(st.sampled_from(_SEEDS)))
    for _ in range(draw(st.integers(0, 8))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        data = data[:draw(st.integers(0, len(data)))]
    return bytes(data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=512), _mutated()))
def test_fuzzed_bytes_give_an_rgb_image_or_a_bad_request(data):
    start = time.monotonic()
    try:
        image = load_image(data, FIELD, _FUZZ_POLICY)
    except BadRequestError as e:
        assert str(e).startswith(FIELD)
    else:
        assert image.mode == "RGB" and image.width * image.height <= 4_000_000
        image_hash(image)
    assert time.monotonic() - start < 5


def test_the_module_needs_no_torch_and_no_engine_layer():
    """Images are checked in the caller's thread by the front end (and by a process with no model): the module
    imports PIL, numpy and the standard library, and of ember only the shared errors and range checks."""
    import ast
    import sys

    import ember.frontend.media as media

    tree = ast.parse(Path(media.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    third = {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"__future__"}
    assert third == {"PIL", "numpy", "ember"}
    assert {n for n in names if n.startswith("ember")} == {"ember.errors", "ember.config.checks"}
