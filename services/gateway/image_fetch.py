"""Fetching images given by http(s) URL, for the runs that enable it (`RunSpec.fetch_image_urls`;
off by default: such URLs are refused with 400).

The gateway sits inside the stack, next to the store, the engines and Redis, which a rollout's
sandbox keeps the harness from: a fetch must not become the harness's way in. So a fetch
- resolves the name itself and refuses it unless every address it resolves to is public
  (`public_address`: not loopback, private, link-local, shared, reserved, multicast or
  unspecified; an IPv4-mapped IPv6 address is judged as its IPv4 one), then connects to one of
  those very addresses (the name is not resolved again: no DNS rebinding), with the name as the
  `Host` header and as the TLS server name, which the certificate must match;
- follows no redirect (a 3xx is refused) and uses no proxy from the environment;
- reads at most `max_bytes` of body and takes at most `timeout_s` in all.
The bytes are then checked as an inline image's are (`images.RequestImages`) and sent to the
engine as a data URL, so vLLM fetches nothing itself.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

import httpx

Resolve = Callable[[str, int], Awaitable[list[str]]]


class FetchRefused(Exception):
    """The URL is not fetched, or its fetch failed: the request is answered 400."""


# IPv6's global unicast range, less the ranges that carry an IPv4 address inside (6to4,
# Teredo; NAT64's 64:ff9b::/96 and 64:ff9b:1::/48 and the IPv4-compatible ::/96 lie outside it)
_GLOBAL_V6 = ipaddress.ip_network("2000::/3")
_EMBEDS_V4 = (ipaddress.ip_network("2002::/16"), ipaddress.ip_network("2001::/32"))


def public_address(ip: str) -> bool:
    """Whether the gateway may connect to `ip` for a harness."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        elif addr not in _GLOBAL_V6 or any(addr in net for net in _EMBEDS_V4):
            return False
    return addr.is_global and not addr.is_multicast


async def _resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class ImageFetcher:
    def __init__(self, max_bytes: int, timeout_s: float, resolve: Resolve = _resolve,
                 connect_port: dict[str, int] | None = None) -> None:
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.resolve = resolve
        # Test double only (tests/test_gateway_images.py): connects to 127.0.0.1 at the given
        # port where the checked address was this key. No setting reaches it.
        self._connect_port = connect_port or {}

    async def fetch(self, url: str) -> bytes:
        try:
            return await asyncio.wait_for(self._fetch(url), self.timeout_s)
        except asyncio.TimeoutError:
            raise FetchRefused(f"fetching the image took over {self.timeout_s:g} s "
                               "(image_fetch_timeout_s)") from None

    async def _fetch(self, url: str) -> bytes:
        try:
            return await self._get(url)
        except (ValueError, UnicodeError, httpx.InvalidURL) as err:  # a malformed URL
            raise FetchRefused(f"the image URL is malformed: {err}") from None

    async def _get(self, url: str) -> bytes:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise FetchRefused("an http(s) URL with a host is required")
        if parts.username is not None or parts.password is not None:
            raise FetchRefused("image URLs with credentials are not fetched")
        host = parts.hostname
        try:
            port = parts.port or (443 if scheme == "https" else 80)
        except ValueError as err:
            raise FetchRefused(f"bad port: {err}") from None
        try:
            addresses = await self.resolve(host, port)
        except OSError as err:
            raise FetchRefused(f"{host} does not resolve: {err}") from None
        refused = [a for a in addresses if not public_address(a)]
        if not addresses or refused:
            raise FetchRefused(f"{host} resolves to {refused[0] if refused else 'nothing'}, not "
                               "a public address: the gateway fetches images from public "
                               "addresses only")
        ip = addresses[0]
        if ip in self._connect_port:
            ip, port = "127.0.0.1", self._connect_port[ip]
        netloc = (f"[{ip}]" if ":" in ip else ip) + f":{port}"
        target = urlunsplit((scheme, netloc, parts.path or "/", parts.query, ""))
        host_header = host if parts.port is None else f"{host}:{parts.port}"
        async with httpx.AsyncClient(trust_env=False, follow_redirects=False,
                                     timeout=self.timeout_s) as client:
            try:
                async with client.stream("GET", target, headers={"Host": host_header,
                                                             "Accept-Encoding": "identity"},
                                         extensions={"sni_hostname": host}) as resp:
                    if 300 <= resp.status_code < 400:
                        raise FetchRefused(f"the image URL answered {resp.status_code} (a "
                                           "redirect): redirects are not followed")
                    if resp.status_code != 200:
                        raise FetchRefused(f"the image URL answered {resp.status_code}")
                    body = bytearray()
                    async for chunk in resp.aiter_bytes():
                        body += chunk
                        if len(body) > self.max_bytes:
                            raise FetchRefused(f"the image is over the gateway's "
                                               f"{self.max_bytes}-byte limit (max_image_bytes)")
                    return bytes(body)
            except httpx.HTTPError as err:
                raise FetchRefused(f"fetching the image failed: {type(err).__name__}: "
                                   f"{err}") from None
