//! client-go's retry of a request the API server asked to have sent again
//! (`rest.Request`'s `checkWait`): a 429 or 5xx answer carrying
//! `Retry-After: N` (whole seconds) is sent again after N s, up to
//! `MAX_RETRIES` times. API Priority and Fairness sheds load this way: an
//! agent that came back sooner (the watcher's backoff starts at 0.8 s)
//! would add to the load it sheds. Every retry is logged, counted in
//! `rest_client_requests_total{code}` (this layer sits above the one that
//! counts) and makes its kind's watch failing
//! (`lb_source_watch_failing_seconds`) until a watch of it is answered
//! again. An answer without the header is not retried here: the watcher's
//! backoff retries it, reporting the failure.
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use kube::client::Body;

use super::{Status, kind_of};

/// client-go's `maxRetries` for a request.
pub const MAX_RETRIES: u32 = 10;

/// The retry policy of one request (tower clones it per request).
#[derive(Clone)]
pub struct RetryAfter {
    status: Arc<Status>,
    attempts: u32,
}

impl RetryAfter {
    pub fn new(status: Arc<Status>) -> Self {
        RetryAfter { status, attempts: 0 }
    }
}

/// The seconds an answer asks the client to wait before asking again, if
/// it asks (a 429 or 5xx with `Retry-After` in whole seconds; the HTTP-date
/// form is not read, as client-go does not read it).
pub fn asked_wait<B>(resp: &Response<B>) -> Option<u64> {
    let code = resp.status();
    if code != StatusCode::TOO_MANY_REQUESTS && !code.is_server_error() {
        return None;
    }
    resp.headers().get(http::header::RETRY_AFTER)?.to_str().ok()?.trim().parse().ok()
}

impl<B, E> tower::retry::Policy<Request<Body>, Response<B>, E> for RetryAfter {
    type Future = tokio::time::Sleep;

    fn retry(&mut self, req: &mut Request<Body>, result: &mut Result<Response<B>, E>) -> Option<Self::Future> {
        let resp = result.as_ref().ok()?;
        let secs = asked_wait(resp)?;
        let (method, path, code) = (req.method(), req.uri().path(), resp.status().as_u16());
        if self.attempts >= MAX_RETRIES {
            tracing::warn!(code, "{method} {path}: the API server answered {code} and asked to be asked again in {secs} s, {MAX_RETRIES} times: giving up on this request (the watcher retries with its backoff)");
            return None;
        }
        self.attempts += 1;
        if let Some(kind) = kind_of(path) {
            self.status.failed(kind);
        }
        tracing::warn!(
            code,
            retry_after_s = secs,
            attempt = self.attempts,
            "{method} {path}: the API server answered {code} and asks to be asked again in {secs} s: retrying then ({} of {MAX_RETRIES})",
            self.attempts
        );
        Some(tokio::time::sleep(Duration::from_secs(secs)))
    }

    fn clone_request(&mut self, req: &Request<Body>) -> Option<Request<Body>> {
        // A body being streamed cannot be sent again (lists and watches
        // have none).
        let mut again = Request::builder().method(req.method().clone()).uri(req.uri().clone()).version(req.version());
        *again.headers_mut()? = req.headers().clone();
        let mut again = again.body(req.body().try_clone()?).ok()?;
        *again.extensions_mut() = req.extensions().clone();
        Some(again)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(code: u16, retry_after: Option<&str>) -> Response<()> {
        let mut b = Response::builder().status(code);
        if let Some(v) = retry_after {
            b = b.header("Retry-After", v);
        }
        b.body(()).unwrap()
    }

    /// A request the server keeps asking to have sent again is sent again
    /// `MAX_RETRIES` times, client-go's 10, then left to the watcher's
    /// backoff; a list (no body) can be sent again.
    #[tokio::test]
    async fn a_request_is_sent_again_at_most_max_retries_times() {
        use tower::retry::Policy as _;
        let mut p = RetryAfter::new(Arc::new(Status::default()));
        let mut req = Request::builder().uri("/api/v1/services?limit=500").body(Body::empty()).unwrap();
        assert!(<RetryAfter as tower::retry::Policy<Request<Body>, Response<()>, ()>>::clone_request(&mut p, &req).is_some());
        let mut sent_again = 0;
        loop {
            let mut r: Result<Response<()>, ()> = Ok(answer(429, Some("0")));
            match p.retry(&mut req, &mut r) {
                Some(wait) => wait.await,
                None => break,
            }
            sent_again += 1;
            assert!(sent_again <= MAX_RETRIES, "never given up");
        }
        assert_eq!((sent_again, MAX_RETRIES), (10, 10));
        // Without the header: not here (the watcher's backoff).
        let mut p = RetryAfter::new(Arc::new(Status::default()));
        assert!(p.retry(&mut req, &mut Ok::<_, ()>(answer(429, None))).is_none());
    }

    #[test]
    fn only_429_and_5xx_with_whole_seconds_ask_for_a_wait() {
        assert_eq!(asked_wait(&answer(429, Some("3"))), Some(3));
        assert_eq!(asked_wait(&answer(503, Some(" 1 "))), Some(1));
        assert_eq!(asked_wait(&answer(500, Some("0"))), Some(0));
        assert_eq!(asked_wait(&answer(429, None)), None, "no header: the watcher's backoff");
        assert_eq!(asked_wait(&answer(429, Some("Wed, 21 Oct 2015 07:28:00 GMT"))), None);
        assert_eq!(asked_wait(&answer(429, Some("-1"))), None);
        assert_eq!(asked_wait(&answer(404, Some("1"))), None);
        assert_eq!(asked_wait(&answer(200, Some("1"))), None);
    }
}
