//! Connections: the accept loop and what each connection is allowed.
//!
//! axum's `serve` has no read, idle or write timeouts and no connection cap, so a client that
//! opens connections and sends nothing (or half a request) holds them for as long as it likes.
//! Here every connection is served by hyper's HTTP/1 connection with a watchdog beside it:
//!
//! - a request head (request line and headers) must be complete within `header_read` of the
//!   connection's opening, or of the first byte of a later request on a kept-alive connection;
//! - a kept-alive connection with no new request for `idle` is closed;
//! - a response write that makes no progress for `write_stall` (the client stopped reading)
//!   closes the connection, which also frees the request's slot;
//! - nothing limits how long a response takes while the client keeps reading it: a stream may
//!   run for hours.
//!
//! hyper's own `header_read_timeout` is not used because it cannot tell a slow head from an idle
//! connection: hyper arms it whenever it waits for a request head, and after each response it
//! starts that wait at once (`proto/h1/conn.rs`: `State::idle` sets `notify_read` "so we can close
//! the connection if another header isn't received in a timely manner"), so its timeout would
//! also be the keep-alive idle timeout.
//!
//! At `max_connections` open connections the loop stops accepting: new connections wait in the
//! kernel's listen backlog until one closes (as Apache's `MaxRequestWorkers` and Go's
//! `netutil.LimitListener` do), instead of being accepted and closed: the cap is reached in
//! bursts that clear in moments, and a client that waits a little is better served than one that
//! gets a reset it must retry.
//!
//! hyper answers a request it cannot parse itself (400, 414, 431) with an empty body; the
//! connection's writer replaces that answer with the same status and an OpenAI-style JSON error,
//! so every refusal carries one.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{Request, Response, StatusCode};
use axum::Router;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Notify, Semaphore};
use tokio::time::Instant;

use crate::error::ApiError;

/// Largest request head (request line and headers) read; a larger one is answered 431. Generous
/// for API clients (a long bearer token is a few KiB) and small enough that a thousand
/// connections reading heads cannot hold much memory.
pub const MAX_HEAD_BYTES: usize = 64 << 10;

/// Most headers in a request (hyper's default); more are answered 431 as well.
pub const MAX_HEADERS: usize = 100;

/// After answering a request hyper could not parse, the connection reads and drops what the
/// client still sends for up to this long and this many bytes before it closes: closing a socket
/// with unread data resets the connection, and the reset can destroy the answer before the
/// client reads it (nginx's lingering close, for the same reason).
const LINGER_TIME: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 4 << 20;

/// What a connection is allowed; see the module documentation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub header_read: Duration,
    pub idle: Duration,
    pub write_stall: Duration,
    pub max_connections: usize,
}

/// Why the server closed a connection on its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expiry {
    /// The request head did not arrive in time.
    HeaderRead,
    /// No new request on a kept-alive connection.
    Idle,
    /// The client stopped reading the response.
    WriteStall,
}

impl Expiry {
    pub const ALL: [Expiry; 3] = [Expiry::HeaderRead, Expiry::Idle, Expiry::WriteStall];

    /// The `reason` label in `/metrics`.
    pub fn label(self) -> &'static str {
        match self {
            Expiry::HeaderRead => "header_read",
            Expiry::Idle => "idle",
            Expiry::WriteStall => "write",
        }
    }
}

/// Connection counters for `/metrics`.
#[derive(Debug, Default)]
pub struct ConnStats {
    open: AtomicUsize,
    accepted: AtomicU64,
    expired: [AtomicU64; 3],
}

impl ConnStats {
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    pub fn accepted_total(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    pub fn expired_total(&self, why: Expiry) -> u64 {
        self.expired[why as usize].load(Ordering::Relaxed)
    }

    fn expired(&self, why: Expiry) {
        self.expired[why as usize].fetch_add(1, Ordering::Relaxed);
    }
}

/// Counts a connection as open for as long as it lives.
struct OpenGuard(Arc<ConnStats>);

impl OpenGuard {
    fn new(stats: Arc<ConnStats>) -> Self {
        stats.open.fetch_add(1, Ordering::Relaxed);
        stats.accepted.fetch_add(1, Ordering::Relaxed);
        OpenGuard(stats)
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a connection is waiting for, which decides its read deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wait {
    /// A request head whose wait began then (the connection's opening for the first request).
    Head(Instant),
    /// A new request on a kept-alive connection, since then.
    Idle(Instant),
    /// Nothing: a request is being served.
    Busy,
}

#[derive(Debug)]
struct State {
    wait: Wait,
    /// Requests handed to the router whose response has not ended.
    in_flight: usize,
    /// Responses the router returned whose head has not been written yet: a response head
    /// written while none is due is one hyper wrote itself.
    heads_due: usize,
    /// Since when a write has been waiting for the client to read.
    write_blocked: Option<Instant>,
}

/// One connection's state, shared by its reader/writer, its service and its watchdog.
#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    /// Wakes the watchdog when a deadline may have moved earlier.
    changed: Notify,
}

impl Shared {
    fn new(opened: Instant) -> Self {
        Shared {
            state: Mutex::new(State {
                wait: Wait::Head(opened),
                in_flight: 0,
                heads_due: 0,
                write_blocked: None,
            }),
            changed: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent even if a holder panicked: every update is one assignment.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes arrived: on an idle connection they start a request head.
    fn on_read(&self) {
        let mut s = self.lock();
        if let Wait::Idle(_) = s.wait {
            s.wait = Wait::Head(Instant::now());
            drop(s);
            self.changed.notify_waiters();
        }
    }

    fn request_started(&self) {
        let mut s = self.lock();
        s.in_flight += 1;
        s.wait = Wait::Busy;
    }

    fn request_ended(&self) {
        let mut s = self.lock();
        s.in_flight = s.in_flight.saturating_sub(1);
        if s.in_flight == 0 {
            s.wait = Wait::Idle(Instant::now());
            drop(s);
            self.changed.notify_waiters();
        }
    }

    fn head_returned(&self) {
        self.lock().heads_due += 1;
    }

    fn write_blocked(&self, blocked: bool) {
        let mut s = self.lock();
        s.write_blocked = blocked.then(Instant::now);
        drop(s);
        if blocked {
            self.changed.notify_waiters();
        }
    }

    /// What a write (one whole buffer from hyper) begins.
    fn classify(&self, buf: &[u8]) -> Written {
        let Some(status) = response_status(buf) else {
            return Written::Other;
        };
        if status.is_informational() {
            // `100 Continue`, written while the router reads the body.
            return Written::Other;
        }
        if self.lock().heads_due > 0 {
            return Written::RoutedHead;
        }
        // hyper's own answers are a bare head: no body, no content type. A router response
        // always has a content type, and bodies here are JSON, SSE or text without a CR, so a
        // write in the middle of one never looks like this.
        let Some(head_end) = find(buf, b"\r\n\r\n").map(|i| i + 4) else {
            return Written::Other;
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        let bare = head_end == buf.len()
            && head.contains("\r\ncontent-length: 0\r\n")
            && !head.contains("\r\ncontent-type:");
        if bare && (status.is_client_error() || status.is_server_error()) {
            Written::HyperAnswer(status)
        } else {
            Written::Other
        }
    }

    /// A head the router's response was due for went out (at least its first bytes).
    fn head_written(&self) {
        let mut s = self.lock();
        s.heads_due = s.heads_due.saturating_sub(1);
    }

    /// The next deadline and what it is for.
    fn deadline(&self, limits: &Limits) -> Option<(Instant, Expiry)> {
        let s = self.lock();
        let read = match s.wait {
            Wait::Head(t) => Some((t + limits.header_read, Expiry::HeaderRead)),
            Wait::Idle(t) => Some((t + limits.idle, Expiry::Idle)),
            Wait::Busy => None,
        };
        let write = s
            .write_blocked
            .map(|t| (t + limits.write_stall, Expiry::WriteStall));
        match (read, write) {
            (Some(r), Some(w)) => Some(if w.0 < r.0 { w } else { r }),
            (r, w) => r.or(w),
        }
    }
}

/// What a write hyper hands the socket begins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Written {
    /// The head of a response the router returned.
    RoutedHead,
    /// An answer hyper wrote itself (a request it could not parse), without a body.
    HyperAnswer(StatusCode),
    /// Anything else: body bytes, `100 Continue`.
    Other,
}

/// `HTTP/1.x NNN ...` at the start of `buf`: the status.
fn response_status(buf: &[u8]) -> Option<StatusCode> {
    let rest = buf.strip_prefix(b"HTTP/1.")?;
    if rest.get(1) != Some(&b' ') {
        return None;
    }
    StatusCode::from_bytes(rest.get(2..5)?).ok()
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The answer that replaces hyper's empty one: its status line and `date`, a JSON error body.
fn json_answer(status: StatusCode, hyper_head: &[u8]) -> Vec<u8> {
    let message = match status {
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => format!(
            "the request head is too large: at most {} KiB of request line and headers, and {MAX_HEADERS} headers",
            MAX_HEAD_BYTES >> 10
        ),
        StatusCode::URI_TOO_LONG => "the request target is too long".to_string(),
        StatusCode::BAD_REQUEST => "malformed HTTP request".to_string(),
        other => other
            .canonical_reason()
            .unwrap_or("the request was refused")
            .to_string(),
    };
    let body = ApiError::new(status, "invalid_request_error", message)
        .body()
        .to_string();
    let text = String::from_utf8_lossy(hyper_head);
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut out = format!("{status_line}\r\n");
    for line in lines.filter(|l| l.to_ascii_lowercase().starts_with("date:")) {
        out += line;
        out += "\r\n";
    }
    out += &format!(
        "content-type: application/json; charset=utf-8\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    out.into_bytes()
}

/// The socket as hyper sees it: reads and writes are reported to the connection's state, and an
/// empty answer hyper writes itself is replaced by a JSON one.
struct Watched {
    io: TcpStream,
    shared: Arc<Shared>,
    /// A replacement answer and how much of it is written.
    replacement: Option<(Vec<u8>, usize)>,
    /// The last write waited for the client (reported on change only).
    blocked: bool,
    /// Set once a replacement answer is written: the close lingers.
    linger: Option<Linger>,
}

/// The close after an answer to a request hyper could not parse (see [`LINGER_TIME`]).
struct Linger {
    until: Pin<Box<tokio::time::Sleep>>,
    drained: usize,
    fin_sent: bool,
}

impl Linger {
    fn new() -> Self {
        Linger {
            until: Box::pin(tokio::time::sleep(LINGER_TIME)),
            drained: 0,
            fin_sent: false,
        }
    }

    /// Send the end of stream, then drop what arrives until the client closes or the time or
    /// byte budget is spent.
    fn poll_close(&mut self, io: &mut TcpStream, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.fin_sent {
            ready!(Pin::new(&mut *io).poll_shutdown(cx))?;
            self.fin_sent = true;
        }
        let mut scratch = [0u8; 8192];
        while self.drained < LINGER_BYTES {
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut *io).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if buf.filled().is_empty() => break,
                Poll::Ready(Ok(())) => self.drained += buf.filled().len(),
                Poll::Ready(Err(_)) => break,
                Poll::Pending => {
                    ready!(self.until.as_mut().poll(cx));
                    break;
                }
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl Watched {
    fn set_blocked(&mut self, blocked: bool) {
        if self.blocked != blocked {
            self.blocked = blocked;
            self.shared.write_blocked(blocked);
        }
    }

    /// Write what is left of a replacement answer.
    fn poll_replacement(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some((bytes, at)) = &mut self.replacement {
            if *at >= bytes.len() {
                self.replacement = None;
                break;
            }
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &bytes[*at..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            *at += n;
        }
        Poll::Ready(Ok(()))
    }

    fn write(&mut self, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        ready!(self.poll_replacement(cx))?;
        match self.shared.classify(buf) {
            Written::HyperAnswer(status) => {
                self.replacement = Some((json_answer(status, buf), 0));
                self.linger = Some(Linger::new());
                // hyper's bytes are taken; ours go out now or on the flush that follows.
                if let Poll::Ready(Err(e)) = self.poll_replacement(cx) {
                    return Poll::Ready(Err(e));
                }
                Poll::Ready(Ok(buf.len()))
            }
            Written::RoutedHead => {
                let r = ready!(Pin::new(&mut self.io).poll_write(cx, buf));
                // Counted once written: hyper hands the same head again after a `Pending`.
                if matches!(r, Ok(n) if n > 0) {
                    self.shared.head_written();
                }
                Poll::Ready(r)
            }
            Written::Other => Pin::new(&mut self.io).poll_write(cx, buf),
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.shared.on_read();
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = this.write(cx, buf);
        this.set_blocked(r.is_pending());
        r
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = match this.poll_replacement(cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut this.io).poll_flush(cx),
            other => other,
        };
        this.set_blocked(r.is_pending());
        r
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_replacement(cx))?;
        match &mut this.linger {
            Some(linger) => linger.poll_close(&mut this.io, cx),
            None => Pin::new(&mut this.io).poll_shutdown(cx),
        }
    }
}

/// A request counted in flight from the router's call until its response body ends (or is
/// dropped: the client went away).
struct InFlight(Arc<Shared>);

impl InFlight {
    fn begin(shared: Arc<Shared>) -> Self {
        shared.request_started();
        InFlight(shared)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.request_ended();
    }
}

/// A response body that keeps its request in flight while hyper writes it.
pub(crate) struct Guarded {
    body: Body,
    _in_flight: InFlight,
}

impl http_body::Body for Guarded {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The router as one connection's hyper service.
struct Tracked {
    router: TowerToHyperService<Router>,
    shared: Arc<Shared>,
}

type ResponseFuture = Pin<Box<dyn Future<Output = Result<Response<Guarded>, Infallible>> + Send>>;

impl hyper::service::Service<Request<Incoming>> for Tracked {
    type Response = Response<Guarded>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn call(&self, req: Request<Incoming>) -> ResponseFuture {
        let in_flight = InFlight::begin(self.shared.clone());
        let shared = self.shared.clone();
        let answer = self.router.call(req);
        Box::pin(async move {
            let res = answer.await?;
            shared.head_returned();
            Ok(res.map(|body| Guarded {
                body,
                _in_flight: in_flight,
            }))
        })
    }
}

/// Resolves when the connection's current deadline passes.
async fn expiry(shared: &Shared, limits: Limits) -> Expiry {
    loop {
        // Registered before the state is read, so a change in between still wakes this.
        let changed = shared.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        match shared.deadline(&limits) {
            Some((at, why)) if at <= Instant::now() => return why,
            Some((at, _)) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(at) => {}
                    _ = changed => {}
                }
            }
            None => changed.await,
        }
    }
}

/// Serve one connection until it ends, a deadline passes, or the server stops (`stop` holds the
/// instant by which every connection must be gone).
async fn serve_connection(
    stream: TcpStream,
    router: TowerToHyperService<Router>,
    limits: Limits,
    mut stop: watch::Receiver<Option<Instant>>,
    stats: Arc<ConnStats>,
) {
    let _open = OpenGuard::new(stats.clone());
    let shared = Arc::new(Shared::new(Instant::now()));
    let io = TokioIo::new(Watched {
        io: stream,
        shared: shared.clone(),
        replacement: None,
        blocked: false,
        linger: None,
    });
    let service = Tracked {
        router,
        shared: shared.clone(),
    };
    let conn = http1::Builder::new()
        // The watchdog keeps the read deadlines (see the module documentation).
        .header_read_timeout(None)
        .max_header_size(MAX_HEAD_BYTES)
        .max_headers(MAX_HEADERS)
        .serve_connection(io, service);
    tokio::pin!(conn);
    let expired = expiry(&shared, limits);
    tokio::pin!(expired);
    let mut gone_by: Option<Instant> = None;
    loop {
        tokio::select! {
            // An error here is a client that went away or sent garbage: nothing to report.
            _ = conn.as_mut() => return,
            why = &mut expired => {
                stats.expired(why);
                return;
            }
            at = stop.wait_for(Option::is_some), if gone_by.is_none() => {
                let at = at.ok().and_then(|v| *v).unwrap_or_else(Instant::now);
                // Finish the request in flight, if any, then close.
                conn.as_mut().graceful_shutdown();
                gone_by = Some(at);
            }
            _ = tokio::time::sleep_until(gone_by.unwrap_or_else(Instant::now)), if gone_by.is_some() => return,
        }
    }
}

/// An accept error that concerns one connection only (the client gave up before it was taken).
fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// Logs a condition at most once a minute.
struct Notice(Option<Instant>);

impl Notice {
    fn due(&mut self) -> bool {
        let now = Instant::now();
        if self.0.is_some_and(|t| now < t + Duration::from_secs(60)) {
            return false;
        }
        self.0 = Some(now);
        true
    }
}

/// Accept and serve connections until `stop` resolves with the instant by which every
/// connection must be gone; then stop accepting (the listener is closed, so new connections are
/// refused), let each connection finish its request in flight, and return when all are closed
/// or that instant has passed.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    stats: Arc<ConnStats>,
    stop: impl Future<Output = Instant>,
) {
    let (stop_tx, stop_rx) = watch::channel(None);
    // Every connection task holds a sender: `recv` answers `None` once the last has ended.
    let (alive_tx, mut alive_rx) = mpsc::channel::<Infallible>(1);
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let router = TowerToHyperService::new(router);
    let mut at_cap = Notice(None);
    let mut accept_failed = Notice(None);
    tokio::pin!(stop);
    let gone_by = loop {
        let permit = match permits.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                if at_cap.due() {
                    eprintln!(
                        "{} connections open (--max-connections): new connections wait in the listen backlog",
                        limits.max_connections
                    );
                }
                tokio::select! {
                    p = permits.clone().acquire_owned() => match p {
                        Ok(p) => p,
                        // The semaphore is never closed.
                        Err(_) => continue,
                    },
                    at = &mut stop => break at,
                }
            }
        };
        let accepted = tokio::select! {
            r = listener.accept() => r,
            at = &mut stop => break at,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                // Out of file descriptors or memory: wait for connections to close rather than
                // spinning on the error.
                if accept_failed.due() {
                    eprintln!("cannot accept a connection: {e}; retrying");
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(100)) => continue,
                    at = &mut stop => break at,
                }
            }
        };
        // Streamed tokens are small writes: send each at once rather than waiting for an ACK.
        let _ = stream.set_nodelay(true);
        let (router, stop_rx, stats, alive) = (
            router.clone(),
            stop_rx.clone(),
            stats.clone(),
            alive_tx.clone(),
        );
        tokio::spawn(async move {
            serve_connection(stream, router, limits, stop_rx, stats).await;
            drop(permit);
            drop(alive);
        });
    };
    drop(listener);
    let _ = stop_tx.send(Some(gone_by));
    drop(alive_tx);
    // The connections end themselves by `gone_by`; the margin covers their last wake-up.
    tokio::select! {
        _ = alive_rx.recv() => {}
        _ = tokio::time::sleep_until(gone_by + Duration::from_secs(1)) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            header_read: Duration::from_secs(10),
            idle: Duration::from_secs(75),
            write_stall: Duration::from_secs(60),
            max_connections: 4,
        }
    }

    #[test]
    fn deadlines_follow_the_connection() {
        let t0 = Instant::now();
        let s = Shared::new(t0);
        let l = limits();
        assert_eq!(
            s.deadline(&l),
            Some((t0 + l.header_read, Expiry::HeaderRead))
        );
        s.request_started();
        assert_eq!(
            s.deadline(&l),
            None,
            "nothing limits a request being served"
        );
        s.write_blocked(true);
        let (at, why) = s.deadline(&l).unwrap();
        assert_eq!(why, Expiry::WriteStall);
        assert!(at >= t0 + l.write_stall);
        s.write_blocked(false);
        s.request_ended();
        let (at, why) = s.deadline(&l).unwrap();
        assert_eq!(why, Expiry::Idle);
        assert!(at >= t0 + l.idle);
        // The first byte of the next request: the head has `header_read` from now.
        s.on_read();
        let (at, why) = s.deadline(&l).unwrap();
        assert_eq!(why, Expiry::HeaderRead);
        assert!(at < t0 + l.idle);
        // More bytes of the same head do not extend it.
        s.on_read();
        assert_eq!(s.deadline(&l), Some((at, why)));
    }

    #[test]
    fn only_hyper_answers_are_replaced() {
        let s = Shared::new(Instant::now());
        let bare = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: Mon, 01 Jan 2029 00:00:00 GMT\r\n\r\n";
        assert_eq!(
            s.classify(bare),
            Written::HyperAnswer(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
        );
        // A head the router's response is due for is never replaced, whatever its shape, and
        // stays due until written.
        s.head_returned();
        assert_eq!(s.classify(bare), Written::RoutedHead);
        assert_eq!(s.classify(bare), Written::RoutedHead);
        s.head_written();
        assert_eq!(
            s.classify(bare),
            Written::HyperAnswer(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
        );
        let routed = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(s.classify(routed), Written::Other);
        assert_eq!(
            s.classify(b"HTTP/1.1 100 Continue\r\n\r\n"),
            Written::Other,
            "100 Continue is not an answer"
        );
        assert_eq!(s.classify(b"1a\r\ndata: {}\n\n\r\n"), Written::Other);
        assert_eq!(
            s.classify(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"),
            Written::Other
        );

        let answer = String::from_utf8(json_answer(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            bare,
        ))
        .unwrap();
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"));
        assert!(head.contains("\r\ndate: Mon, 01 Jan 2029 00:00:00 GMT"));
        assert!(head.contains(&format!("\r\ncontent-length: {}", body.len())));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], 431);
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
}
