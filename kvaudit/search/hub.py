"""A campaign across machines: workers on many hosts share one Redis (``kvaudit fuzz --db URL``).

Each worker mirrors its local campaign directory through the keys ``kvaudit:<campaign>:*``: a bug is claimed,
triaged and registered once across the fleet, and Redis going away never stops a worker. Design notes (the
keys, claims, the outbox): docs/internals/search.md.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from typing import Callable

from hypothesis.database import ExampleDatabase

from kvaudit import replay
from kvaudit.config import json_value

RETRY_EVERY = 2.0  # seconds between reconnection attempts while Redis is away
DEFAULT_TTL = 30.0  # seconds a claim and a heartbeat live without renewal
TTL_ENV = "KVAUDIT_FLEET_TTL"  # what sets it (a test's short one, a slow fleet's long one)
MAX_TTL = 24 * 3600.0  # a claim a dead worker held is free again within a day
BEAT_EVERY = 2.0  # at most this many seconds between heartbeats (ttl/3 when shorter): `campaign status`'s figures

# NOTE: the claim and the registration are Lua scripts so that each is one atomic step in Redis: two
# workers that find one bug's signatures at once (or in another order) cannot split them between them.
# KEYS: known, pending, duplicates, claim:<s1>..claim:<sn>; ARGV: worker, ttl, pending doc, s1..sn.
# Returns the signatures this worker holds now (claimed here, or already its own).
_CLAIM = """
local got = {}
for i = 4, #KEYS do
  local s = ARGV[i]
  local holder = redis.call('GET', KEYS[i])
  if redis.call('SISMEMBER', KEYS[1], s) == 1 or (holder and holder ~= ARGV[1]) then
    redis.call('HINCRBY', KEYS[3], s, 1)
  else
    if not holder then
      redis.call('SET', KEYS[i], ARGV[1], 'EX', ARGV[2])
      redis.call('HSET', KEYS[2], s, ARGV[3])
    end
    table.insert(got, s)
  end
end
return got
"""
# KEYS: known, findings, pending, duplicates, claim:<s1>..claim:<sn>; ARGV: worker, file text, s1..sn (the
# file's signatures, its primary first). Returns the signatures no file recorded before.
_REGISTER = """
local new = {}
for i = 5, #KEYS do
  local s = ARGV[i - 2]
  local mine = redis.call('GET', KEYS[i]) == ARGV[1]
  if redis.call('SISMEMBER', KEYS[1], s) == 0 then
    table.insert(new, s)
  elseif mine then
    redis.call('HINCRBY', KEYS[4], s, 1)
  end
  if mine then redis.call('DEL', KEYS[i]) end
  redis.call('HDEL', KEYS[3], s)
end
if #new > 0 then
  redis.call('SADD', KEYS[1], unpack(new))
  redis.call('HSET', KEYS[2], new[1], ARGV[2])
end
return new
"""
# KEYS: claim:<s1>..; ARGV: worker. Ends this worker's claims (not another's that took over an expired one).
_RELEASE = """
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then redis.call('DEL', KEYS[i]) end
end
return 0
"""


def fleet_ttl() -> float:
    """Seconds a claim or heartbeat lives unrenewed: ``$KVAUDIT_FLEET_TTL``, else :data:`DEFAULT_TTL`. Raises
    ``ValueError`` (one line) for a value that is not a number of seconds in ``(0, MAX_TTL]``."""
    raw = os.environ.get(TTL_ENV, "").strip()
    if not raw:
        return DEFAULT_TTL
    try:
        ttl = float(raw)
    except ValueError:
        ttl = math.nan
    if not (math.isfinite(ttl) and 0 < ttl <= MAX_TTL):  # (nan, inf: Redis takes whole seconds, int() refuses)
        raise ValueError(f"{TTL_ENV}={json_value(raw, 40)}: want a number of seconds > 0 and at most {MAX_TTL:.0f}")
    return ttl


class HubError(Exception):
    """Redis cannot be reached when the campaign starts, or the URL is not a Redis URL (one line)."""


class BadURL(HubError):
    """The URL is bad input: unparsable, or asking what the server refuses (a DB index out of range)."""


def _redis_errors() -> tuple[type, ...]:
    import redis

    return (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


# NOTE: redis-py hands any query key it does not know to the connection, whose constructor raises TypeError
# at the first command; these are the ones it reads (the TLS ones: redis.connection.SSLConnection).
URL_OPTIONS = ("db", "socket_timeout", "socket_connect_timeout", "socket_keepalive", "retry_on_timeout",
               "health_check_interval", "max_connections", "client_name", "protocol", "username", "password")
TLS_OPTIONS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_password",
               "ssl_check_hostname", "ssl_min_version", "ssl_ciphers")


def check_url(url: str) -> None:
    """Raises :class:`BadURL` (one line, the password masked) unless ``url`` is a ``redis://``,
    ``rediss://`` (TLS) or ``unix://PATH`` URL with a port in 1-65535, a numeric database index
    (``/N`` or ``?db=N``; redis-py reads ``/abc`` as DB 0) and only the query options
    :data:`URL_OPTIONS` (and :data:`TLS_OPTIONS` with ``rediss://``), each once."""
    from urllib.parse import parse_qsl, unquote, urlsplit

    where = f"--db {json_value(safe_url(url))}"
    try:
        parts = urlsplit(url)
        port = parts.port  # (raises for a port that is not a number, or out of 0-65535)
    except ValueError as e:
        raise BadURL(f"{where}: {e}") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise BadURL(f"{where}: want a Redis URL (redis://HOST:PORT/N, rediss://... or unix://PATH)")
    if port == 0:
        raise BadURL(f"{where}: port 0 is not a port to connect to (want 1-65535)")
    if parts.scheme == "unix" and not parts.path:
        raise BadURL(f"{where}: a unix:// URL names the socket's path (unix:///run/redis.sock?db=N)")
    allowed = URL_OPTIONS + (TLS_OPTIONS if parts.scheme == "rediss" else ())
    seen: set[str] = set()
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in allowed:
            tls = " (a TLS option: use rediss://)" if name in TLS_OPTIONS else ""
            raise BadURL(f"{where}: unknown option {json_value(name, 60)}{tls}; the options are {', '.join(allowed)}")
        if name in seen:
            raise BadURL(f"{where}: option {json_value(name, 60)} is given twice")
        if not value:
            raise BadURL(f"{where}: option {json_value(name, 60)} has no value")
        seen.add(name)
    index = unquote(parts.path).strip("/") if parts.scheme != "unix" else ""
    if "db" in seen:
        index = dict(parse_qsl(parts.query))["db"]
    if index and not index.isdigit():
        raise BadURL(f"{where}: the database index {json_value(index, 60)} is not a number (redis://HOST:PORT/N)")


def connect(url: str, timeout: float = 5.0, check: bool = True):
    """A ``redis.Redis`` client for ``url`` that answered a PING (``check``; else not tried yet: a
    worker starts offline rather than not at all). Raises :class:`HubError` (no redis-py or a broken one, nothing
    answering, authentication) and :class:`BadURL`, each one line."""
    check_url(url)
    try:
        import redis
    except ImportError as e:
        if e.name == "redis":  # (redis-py itself missing; else a module redis-py imports: it said which)
            raise HubError("--db needs redis-py: pip install redis (or pip install 'kvaudit[fleet]')") from None
        raise HubError(f"--db: redis-py is installed but cannot be imported here: {type(e).__name__}: {e} "
                       "(a broken install: pip install --force-reinstall redis)") from None
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    except ValueError as e:
        raise BadURL(f"--db {json_value(safe_url(url))}: {e}") from None
    if not check:
        return client
    try:
        client.ping()
    except redis.exceptions.AuthenticationError as e:
        raise HubError(f"--db {json_value(safe_url(url))}: authentication failed: {e}") from None
    except _redis_errors() as e:
        raise HubError(f"--db {json_value(safe_url(url))}: cannot reach Redis: {e}") from None
    except redis.exceptions.ResponseError as e:  # the URL asks what the server refuses (a DB index out of range)
        raise BadURL(f"--db {json_value(safe_url(url))}: {e}") from None
    return client


def safe_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for messages and logs)."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


class Hub:
    """One worker's view of campaign ``campaign`` in Redis. ``client``: from :func:`connect`; ``worker``:
    its id (``host/pid/index``); ``ttl``: seconds a claim or heartbeat lives unrenewed; ``who``: the worker as
    its warnings name it (``worker 1``). Every method returns
    normally while Redis is away (:attr:`online` False): reads give their empty default, writes are queued."""

    def __init__(self, client, campaign: str, worker: str, ttl: float = DEFAULT_TTL, who: str = "this worker"):
        self.r = client
        self.prefix = f"kvaudit:{campaign}:"
        self.worker = worker
        self.who = who  # what its warnings call the worker ("worker 1": each of a campaign's says which)
        self.ttl = ttl
        self.online = True
        self._retry_at = 0.0
        self._outbox: list[Callable] = []  # writes made offline, each redone as write(redis) on reconnection
        self._claims: set[str] = set()
        self._pulled: set[str] = set()  # fleet files found in the folder or written there: never fetched again
        self._programs_out: list[str] = []  # corpus programs not sent yet
        self._cursor = 0  # index into the programs list
        self._lock = threading.RLock()
        self._beat: dict = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.warnings: list[str] = []
        self.outage: str | None = None  # the warning of Redis's last outage (a pull ends on it in one error line)
        self._scripts = {name: client.register_script(src)  # (sent on first use, by SHA after that)
                         for name, src in (("claim", _CLAIM), ("register", _REGISTER), ("release", _RELEASE))}

    def key(self, name: str) -> str:
        return self.prefix + name

    def _call(self, fn: Callable, default=None, redo: Callable | None = None):
        """``fn(redis)``, or ``default`` offline (and ``redo`` queued). Offline, a call before the retry time
        fails at once."""
        with self._lock:
            if self.online or time.monotonic() >= self._retry_at:
                try:
                    if not self.online:
                        self.r.ping()
                        self.online = True
                        self._flush()
                    return fn(self.r)
                except _redis_errors() as e:
                    if self.online:  # (once per outage: the summary says the run was not all shared)
                        self.outage = (f"Redis unreachable from {time.strftime('%H:%M:%S')} ({type(e).__name__}): "
                                       f"{self.who} searched on alone, queueing what it shares")
                        self._warn(self.outage)
                    self.online = False
                    self._retry_at = time.monotonic() + RETRY_EVERY
            if redo is not None:
                self._outbox.append(redo)
            return default

    def _write(self, fn: Callable) -> None:
        self._call(fn, redo=fn)

    def _flush(self) -> None:
        pending, self._outbox = self._outbox, []
        for i, redo in enumerate(pending):
            try:
                redo(self.r)
            except _redis_errors():
                self._outbox = pending[i:] + self._outbox
                raise

    def _warn(self, text: str) -> None:
        if text not in self.warnings:
            self.warnings.append(text)

    def register(self, sigs: list[str], text: str) -> list[str] | None:
        """Register the replay file ``text`` recording ``sigs`` (primary first) in one atomic step, before
        it is written: the signatures no file records yet become known and ``text`` is stored under the
        first of them; this worker's claims on ``sigs`` end. Returns those new signatures ([]: a duplicate,
        write nothing), or None offline (the host reports ``sigs`` itself; ``HSETNX`` on reconnection)."""
        held = sorted(set(sigs) & self._claims)
        self._claims.difference_update(sigs)
        keys = [self.key(k) for k in ("known", "findings", "pending", "duplicates")] + [self.key("claim:" + s)
                                                                                        for s in sigs]

        def upload(r):
            r.hsetnx(self.key("findings"), sigs[0], text)
            r.sadd(self.key("known"), *sigs)
            for s in held:
                r.hdel(self.key("pending"), s)
                r.delete(self.key("claim:" + s))

        got = self._call(lambda r: self._scripts["register"](keys, [self.worker, text, *sigs], client=r),
                         redo=upload)
        return None if got is None else [_text(s) for s in got]

    def release(self, sigs) -> None:
        """End this worker's claims on ``sigs`` without a file (its minimized program no longer raises
        them): their pending programs stay, for any worker to re-claim as :meth:`orphans`."""
        mine = sorted(set(sigs) & self._claims)
        self._claims.difference_update(mine)
        if mine:
            self._call(lambda r: self._scripts["release"]([self.key("claim:" + s) for s in mine], [self.worker],
                                                          client=r))

    def flaky(self, sig: str) -> None:
        """``sig`` did not reproduce 3/3: recorded, its claim released."""
        self._claims.discard(sig)

        def write(r):
            r.sadd(self.key("flaky"), sig)
            r.hdel(self.key("pending"), sig)
            r.delete(self.key("claim:" + sig))

        self._write(write)

    def share_program(self, name: str, program_json: list) -> None:
        """Append a corpus program (its store file name and JSON ops) to the campaign's list; buffered, sent
        by the heartbeat and :meth:`stop` so that the search never waits on Redis."""
        with self._lock:
            self._programs_out.append(json.dumps({"name": name, "program": program_json}))

    def flush_programs(self) -> None:
        """Send the buffered corpus programs now (queued while offline)."""
        with self._lock:
            texts, self._programs_out = self._programs_out, []
        if texts:
            self._write(lambda r: r.rpush(self.key("programs"), *texts))

    def example_database(self, local_dir: str):
        """Hypothesis's example database: the directory ``local_dir`` multiplexed with the campaign's
        ``RedisExampleDatabase`` (``kvaudit:<campaign>:hypothesis:``), which reads as empty and queues its
        saves while Redis is away."""
        from hypothesis.database import DirectoryBasedExampleDatabase, MultiplexedDatabase
        from hypothesis.extra.redis import RedisExampleDatabase

        self.example_db = RedisExampleDatabase(self.r, key_prefix=(self.prefix + "hypothesis:").encode())
        return MultiplexedDatabase(DirectoryBasedExampleDatabase(local_dir), _ResilientDatabase(self))

    def claim(self, sigs: list[str], pending_doc: dict) -> list[str]:
        """Claim ``sigs`` (one program's signatures) in one atomic step, uploading ``pending_doc`` (the
        unminimized replay document) with each claim. Returns those this worker holds now; the others are
        known or held by another worker (a duplicate each). Offline: all of them."""
        sigs = list(dict.fromkeys(sigs))
        keys = [self.key(k) for k in ("known", "pending", "duplicates")] + [self.key("claim:" + s) for s in sigs]
        argv = [self.worker, max(1, int(self.ttl)), json.dumps(pending_doc), *sigs]
        got = self._call(lambda r: [_text(s) for s in self._scripts["claim"](keys, argv, client=r)], default=sigs)
        self._claims.update(got)
        return got

    def orphans(self) -> list[tuple[str, dict]]:
        """``(signature, replay document)`` of the pending findings whose claim expired (their worker died
        mid-triage) and that no file records yet."""
        def go(r):
            out = []
            for raw_sig, text in r.hgetall(self.key("pending")).items():
                sig = _text(raw_sig)
                if r.exists(self.key("claim:" + sig)) or r.sismember(self.key("known"), sig):
                    continue
                doc = self._replay_doc(text, "pending", sig)
                if doc is not None:
                    out.append((sig, doc))
            return out

        return self._call(go, default=[])

    def _replay_doc(self, text, where: str, sig: str) -> dict | None:
        """Validated JSON, never unpickled or evaluated; None (and a warning) when malformed."""
        try:
            doc = json.loads(text)
            replay.parse_doc(doc, f"redis {self.key(where)}[{sig}]")
        except (TypeError, ValueError, RecursionError, replay.ReplayFormatError) as e:
            what = "pending finding" if where == "pending" else "finding"
            self._warn(f"skipped a malformed {what} in Redis ({sig}): {e}")
            return None
        return doc

    def known(self) -> set[str]:
        """Every signature the fleet has a replay file for (empty while offline)."""
        got = self._call(lambda r: r.smembers(self.key("known")), default=set())
        return set(map(_text, got))

    def pull_findings(self, directory: str, have: set[str] | None = None, written: list[str] | None = None,
                      kinds: set[str] | None = None, recorded: dict[str, set[str]] | None = None) -> list[str]:
        """Write the fleet's replay files that ``directory`` lacks into it, validated, atomically; ``have``:
        signatures to skip unread (so is a file this hub found there or wrote at an earlier pull: another kind's
        included, which ``have`` lacks). A file of the same name that is not a replay file of the same target kind
        and signature (another kind's, a note) is left as it is: the fleet's takes the next free
        ``<name>.<n>.json`` (:func:`kvaudit.replay.home`). Returns the paths written, each also appended to
        ``written`` as it is; ``kinds``: the target kind of each valid replay file read is added to it;
        ``recorded``: target kind -> the signatures ``directory``'s files record on it (whatever their names): a
        fleet file whose kind records its signature there is read but not written. Raises
        ``OSError`` for a file not written (a full disk: the files are written
        after the reads, so the disk's error is not taken for Redis's)."""
        def go(r):
            sigs = [s for s in map(_text, r.hkeys(self.key("findings")))
                    if s not in self._pulled and (have is None or s not in have)]
            return [(sig, r.hget(self.key("findings"), sig)) for sig in sigs]

        written = [] if written is None else written
        for sig, text in self._call(go, default=[]):
            doc = self._replay_doc(text, "findings", sig)
            if doc is None:
                continue
            kind = replay.target_of(doc)
            if kinds is not None:
                kinds.add(kind)
            path, has_it = replay.home(directory, sig, kind)
            if not has_it and sig not in (recorded or {}).get(kind, ()):
                written.append(replay.write_atomic(path, doc))
            self._pulled.add(sig)
        return written

    def new_programs(self) -> list[tuple[str, list]]:
        """``(name, ops JSON)`` of the corpus programs shared since the last call (the caller validates the
        ops); a malformed entry is skipped with a warning."""
        def go(r):
            items = r.lrange(self.key("programs"), self._cursor, -1)
            self._cursor += len(items)
            out = []
            for text in items:
                try:
                    d = json.loads(text)
                    if not (isinstance(d, dict) and isinstance(d.get("name"), str)
                            and isinstance(d.get("program"), list)):
                        raise ValueError("not {name, program}")
                except (TypeError, ValueError, RecursionError) as e:
                    self._warn(f"skipped a malformed corpus program in Redis: {e}")
                    continue
                out.append((d["name"], d["program"]))
            return out

        return self._call(go, default=[])

    def sync_dir(self, kind: str, directory: str, max_bytes: int = 1 << 20) -> tuple[int, int]:
        """Two-way sync of a folder of opaque inputs (libFuzzer's corpus) with the hash ``<kind>``: files
        Redis lacks go up (``HSETNX``), entries the folder lacks come down (atomically). Only plain names
        (``[A-Za-z0-9_.-]``, no leading dot, at most 128 characters) and contents of at most ``max_bytes``
        pass; others are skipped with a warning. Returns (uploaded, downloaded); (0, 0) offline."""
        os.makedirs(directory, exist_ok=True)
        local = {n for n in os.listdir(directory) if _plain_name(n) and os.path.isfile(os.path.join(directory, n))}

        def go(r):
            remote = set(map(_text, r.hkeys(self.key(kind))))
            up = down = 0
            for name in sorted(local - remote):
                with open(os.path.join(directory, name), "rb") as fh:
                    data = fh.read(max_bytes + 1)
                if len(data) <= max_bytes:
                    up += r.hsetnx(self.key(kind), name, data)
            for name in sorted(remote - local):
                if not _plain_name(name):
                    self._warn(f"skipped a {kind} entry in Redis with a bad name: {json_value(name, 60)}")
                    continue
                data = r.hget(self.key(kind), name)
                if data is None or len(data) > max_bytes:
                    self._warn(f"skipped a {kind} entry in Redis larger than {max_bytes} bytes: {name}")
                    continue
                replay.write_bytes_atomic(os.path.join(directory, name), data, durable=False)
                down += 1
            return up, down

        return self._call(go, default=(0, 0))

    def beat(self, **fields) -> None:
        """Record this worker's figures for the next heartbeat."""
        self._beat.update(fields)

    def _send_beat(self, final: bool = False) -> None:
        """``final``: the key says ``exited`` for good instead of expiring as a killed worker's does."""
        doc = dict(self._beat, worker=self.worker, time=time.time(), state="exited" if final else "alive")
        ex = max(1, int(self.ttl))

        def go(r):
            pipe = r.pipeline()
            pipe.sadd(self.key("workers"), self.worker)
            pipe.set(self.key("worker:" + self.worker), json.dumps(doc), ex=None if final else ex)
            for sig in list(self._claims):
                pipe.expire(self.key("claim:" + sig), ex)
            pipe.execute()

        self._call(go)
        self.flush_programs()

    def start(self) -> "Hub":
        """Start the heartbeat thread: every ``ttl``/3 s, at most :data:`BEAT_EVERY`, it sends the heartbeat
        (the figures ``campaign status`` shows: those of the worker's latest progress), renews this worker's
        claims and sends the shared programs. A daemon: it dies with the process, and so do the claims."""
        # NOTE: the claims' renewal needs ttl/3 only; status figures a heartbeat (10 s at the default ttl) old
        # read as stale mid-run (tester, stop 55)
        every = max(0.2, min(self.ttl / 3, BEAT_EVERY))

        def loop():
            while not self._stop.wait(every):
                self._send_beat()

        self._send_beat()
        self._thread = threading.Thread(target=loop, name="kvaudit-hub-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the heartbeat and send a last one that says the worker exited."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._send_beat(final=True)
        with self._lock:
            if not self.online and self._outbox:
                self._warn(f"Redis still unreachable at the end: {len(self._outbox)} write(s) for the fleet not "
                           f"sent ({self.who}'s findings are in the local corpus only)")


class _ResilientDatabase(ExampleDatabase):
    """The hub's Redis example database behind :meth:`Hub._call`: a failure is an empty read or a
    queued save, never an exception in Hypothesis's engine."""

    def __init__(self, hub: Hub):
        super().__init__()
        self.hub = hub

    def save(self, key: bytes, value: bytes) -> None:
        self.hub._write(lambda r: self.hub.example_db.save(key, value))

    def fetch(self, key: bytes):
        return iter(self.hub._call(lambda r: list(self.hub.example_db.fetch(key)), default=[]))

    def delete(self, key: bytes, value: bytes) -> None:
        self.hub._call(lambda r: self.hub.example_db.delete(key, value))

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.hub._call(lambda r: self.hub.example_db.move(src, dest, value))


def _text(x) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _plain_name(name: str) -> bool:
    return 0 < len(name) <= 128 and not name.startswith(".") and all(c.isascii() and (c.isalnum() or c in "_.-")
                                                                      for c in name)


def check_campaign_name(name: str) -> str:
    """``name``, when it can name a campaign: 1-200 characters, no whitespace or control character (it is
    part of every key and a word of ``campaign status``'s lines). Raises ``ValueError`` saying why not."""
    if not name:
        raise ValueError("a campaign needs a name (it is part of every Redis key)")
    if len(name) > 200:
        raise ValueError(f"at most 200 characters ({len(name)} given)")
    bad = next((c for c in name if c.isspace() or not c.isprintable()), None)
    if bad is not None:
        raise ValueError(f"no whitespace or control characters in a campaign name (it has {json_value(bad)})")
    return name


def worker_id(index: int) -> str:
    """``host/pid/index``: unique per worker process across the fleet."""
    return f"{socket.gethostname()}/{os.getpid()}/{index}"


def campaign_names(client) -> list[str]:
    """The campaigns in this Redis that any worker ever joined, sorted."""
    return sorted({_text(k)[len("kvaudit:"):-len(":workers")]
                   for k in client.scan_iter(match="kvaudit:*:workers", count=1000)})


def campaign_status(client, campaign: str) -> dict:
    """The campaign's figures: ``workers`` (id -> heartbeat dict, its ``state`` ``alive`` or ``exited``;
    None once expired: gone), ``findings``, ``known``, ``pending``, ``flaky`` (sorted signatures),
    ``duplicates`` (signature -> count) and ``programs`` (corpus size)."""
    p = f"kvaudit:{campaign}:"
    workers = {}
    for w in sorted(map(_text, client.smembers(p + "workers"))):
        raw = client.get(p + "worker:" + w)
        try:
            workers[w] = json.loads(raw) if raw is not None else None
        except ValueError:
            workers[w] = None
    return {
        "workers": workers,
        "findings": sorted(map(_text, client.hkeys(p + "findings"))),
        "known": sorted(map(_text, client.smembers(p + "known"))),
        "pending": sorted(map(_text, client.hkeys(p + "pending"))),
        "flaky": sorted(map(_text, client.smembers(p + "flaky"))),
        "duplicates": {_text(k): int(v) for k, v in client.hgetall(p + "duplicates").items()},
        "programs": int(client.llen(p + "programs")),
    }
