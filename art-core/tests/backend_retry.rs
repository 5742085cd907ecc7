//! The backend client retries what cannot have done anything on the server (a 429 or 503, a
//! refused connection) with backoff, and never sends a POST twice after the server may have
//! acted on it. Against a scripted HTTP server. Cost: ~3 s (the backoff's waits).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use art_core::{BackendError, RemoteBackend, TrainableModel};

/// Answers each request with the next scripted status (200 with `ok` once the script runs out),
/// and counts the requests.
#[derive(Clone, Default)]
struct Script {
    statuses: Arc<Mutex<VecDeque<u16>>>,
    requests: Arc<Mutex<usize>>,
}

impl Script {
    fn answer(&self, ok: serde_json::Value) -> Response {
        *self.requests.lock().unwrap() += 1;
        match self.statuses.lock().unwrap().pop_front() {
            Some(code) => {
                let body = json!({"error": {"message": format!("scripted {code}"), "type": "server_error", "param": null, "code": null}});
                (StatusCode::from_u16(code).unwrap(), Json(body)).into_response()
            }
            None => Json(ok).into_response(),
        }
    }

    fn requests(&self) -> usize {
        *self.requests.lock().unwrap()
    }
}

async fn serve(statuses: &[u16]) -> (Script, RemoteBackend) {
    let script = Script {
        statuses: Arc::new(Mutex::new(statuses.iter().copied().collect())),
        ..Script::default()
    };
    let (health, register) = (script.clone(), script.clone());
    let info = json!({"name": "agent", "project": "p", "base_model": "tiny", "step": 0,
                      "lora": {"rank": 8, "alpha": 16.0, "dropout": 0.0,
                               "target_modules": ["q_proj"]}});
    let app = Router::new()
        .route(
            "/health",
            get(move || async move { health.answer(json!({"status": "ok"})) }),
        )
        .route(
            "/v1/art/models",
            post(move || async move { register.answer(info) }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (script, RemoteBackend::new(&url, None))
}

#[tokio::test]
async fn overloaded_answers_are_retried_until_the_server_takes_the_request() {
    let (script, backend) = serve(&[503, 429]).await;
    backend.health().await.unwrap();
    assert_eq!(script.requests(), 3);

    let (script, backend) = serve(&[429, 503]).await;
    let model = TrainableModel::register(&backend, "agent", "p").await;
    assert!(model.is_ok(), "{:?}", model.err());
    assert_eq!(script.requests(), 3);
}

#[tokio::test]
async fn a_post_the_server_may_have_acted_on_is_sent_once() {
    for status in [500, 502, 504] {
        let (script, backend) = serve(&[status]).await;
        let error = TrainableModel::register(&backend, "agent", "p")
            .await
            .unwrap_err();
        assert!(
            matches!(error, BackendError::Api { status: s, .. } if s == status),
            "{error}"
        );
        assert_eq!(script.requests(), 1, "{status}");
    }
    // A GET is safe to repeat: a proxy's 502 is retried.
    let (script, backend) = serve(&[502]).await;
    backend.health().await.unwrap();
    assert_eq!(script.requests(), 2);
}

#[tokio::test]
async fn retries_end_with_the_last_error() {
    let (script, backend) = serve(&[503, 503, 503, 503, 503]).await;
    let error = backend.health().await.unwrap_err();
    assert!(
        matches!(error, BackendError::Api { status: 503, .. }),
        "{error}"
    );
    // The first attempt and three retries.
    assert_eq!(script.requests(), 4);
}
