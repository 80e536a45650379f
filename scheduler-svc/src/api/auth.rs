//! The optional API key (`server.api_key`): both fronts require `Authorization: Bearer KEY` on
//! generation (and on Admin where it listens beyond loopback); health and metrics stay open so
//! probes and scrapers need no secret.

use std::sync::Arc;

use tonic::{Request, Status};

/// The configured key, if any; cheap to clone into every front.
#[derive(Clone, Default)]
pub struct ApiKey(Option<Arc<str>>);

impl ApiKey {
    pub fn new(key: Option<&str>) -> Self {
        Self(key.filter(|k| !k.is_empty()).map(Arc::from))
    }

    pub fn is_set(&self) -> bool {
        self.0.is_some()
    }

    /// Whether an `Authorization` header value lets the request through.
    pub fn admits(&self, authorization: Option<&str>) -> bool {
        let Some(expected) = &self.0 else { return true };
        let Some(given) = authorization.and_then(|value| value.strip_prefix("Bearer ")) else {
            return false;
        };
        constant_time_eq(given.trim().as_bytes(), expected.as_bytes())
    }

    /// A tonic interceptor: `UNAUTHENTICATED` without the key.
    pub fn grpc_interceptor(&self) -> impl Fn(Request<()>) -> Result<Request<()>, Status> + Clone {
        let key = self.clone();
        move |request: Request<()>| {
            let authorization = request.metadata().get("authorization").and_then(|v| v.to_str().ok());
            if key.admits(authorization) {
                Ok(request)
            } else {
                Err(Status::unauthenticated(
                    "a valid API key is required: `authorization: Bearer <key>`",
                ))
            }
        }
    }
}

/// Compares without stopping at the first difference, so timing does not reveal the key.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_bearer_key_passes_when_one_is_set() {
        let open = ApiKey::new(None);
        assert!(open.admits(None));
        let key = ApiKey::new(Some("s3cret"));
        assert!(key.admits(Some("Bearer s3cret")));
        assert!(!key.admits(Some("Bearer s3cre")));
        assert!(!key.admits(Some("s3cret")));
        assert!(!key.admits(None));
    }
}
