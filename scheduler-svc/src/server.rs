//! Assembling and running the listeners, all bound at once (before any worker is ready):
//! - gRPC on `server.listen`: Generation (behind the API key, if set), health, reflection v1 and
//!   v1alpha;
//! - OpenAI-compatible HTTP on `server.http_listen` (`/v1/...`, `/health`, `/metrics`);
//! - Admin on `server.admin_listen` (loopback by default; elsewhere behind the API key), with
//!   health and reflection so `grpcurl` works there too.
//!
//! Health (`SERVING` / 200) follows the engine: true exactly while some worker replica is ready
//! and the server is not shutting down. SIGINT/SIGTERM start a graceful shutdown of all three.

use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::serve::ListenerExt;

use rivulet::proto;
use rivulet::proto::admin_server::AdminServer;
use rivulet::proto::generation_server::GenerationServer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;

use crate::api::admin::AdminService;
use crate::api::auth::ApiKey;
use crate::api::grpc::GenerationService;
use crate::api::http::{self, HttpState};
use crate::api::validation::Validator;
use crate::api::Frontend;
use crate::config::Config;
use crate::engine::{self, EngineHandle};
use crate::guide::{GuideVocabulary, Guides};
use crate::metrics::Metrics;
use crate::model_limits::ModelLimits;
use crate::tokenizer::ModelTokenizer;

type HealthReporter = tonic_health::server::HealthReporter;

/// Loads the tokenizer, starts the workers and the engine, and serves until a shutdown signal.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let model = config.model.path.display().to_string();
    let tokenizer =
        Arc::new(ModelTokenizer::from_model_path(&config.model.path).with_context(|| format!("model {model}"))?);
    let limits = ModelLimits::read(&config.model.path, tokenizer.vocab_size(), config.model.max_model_len)
        .with_context(|| format!("model {model}"))?;
    // Built now rather than on the first request's first token.
    let byte_level = tokenizer.byte_pieces().is_some();
    tracing::info!(
        byte_level,
        "detokenizer ready (byte_level: each token's bytes appended; otherwise windows of tokens decoded)"
    );
    let guides = tokenizer.byte_pieces().map(|pieces| {
        let vocabulary = GuideVocabulary::new(tokenizer.vocab_size(), |id| pieces.get(id), limits.vocab_size);
        Arc::new(Guides::new(vocabulary))
    });
    let served_model_name = config.served_model_name();
    let metrics = Arc::new(Metrics::new(&served_model_name)?);
    // Bound before any worker starts: a taken port fails the start with nothing to clean up.
    let bind = |key: &'static str, address: std::net::SocketAddr| async move {
        TcpListener::bind(address)
            .await
            .with_context(|| format!("{key} {address}"))
    };
    let grpc_listener = bind("server.listen", config.server.listen).await?;
    let http_listener = bind("server.http_listen", config.server.http_listen).await?;
    let admin_listener = bind("server.admin_listen", config.server.admin_listen).await?;
    let (engine, engine_thread) = engine::start(config.clone(), tokenizer.clone(), limits, metrics.clone())?;
    let front = Frontend {
        validator: Arc::new(Validator {
            tokenizer,
            limits: engine.limits.clone(),
            served_model_name: served_model_name.clone(),
            default_max_new_tokens: config.scheduler.default_max_new_tokens,
            default_stop_strings: config.scheduler.default_stop_strings.clone(),
            default_confidence_threshold: config.scheduler.confidence_threshold,
            guides,
        }),
        engine: engine.clone(),
        metrics,
    };
    let api_key = ApiKey::new(config.server.api_key.as_deref());

    let (grpc_address, http_address, admin_address) = (
        grpc_listener.local_addr()?,
        http_listener.local_addr()?,
        admin_listener.local_addr()?,
    );
    // On stdout, for scripts and tests that start the server on port 0.
    println!("rivulet-scheduler listening on {grpc_address}");
    println!("rivulet-scheduler http listening on {http_address}");
    println!("rivulet-scheduler admin listening on {admin_address}");
    tracing::info!(
        grpc = %grpc_address,
        http = %http_address,
        admin = %admin_address,
        model = %served_model_name,
        api_key = api_key.is_set(),
        "listening; workers are loading"
    );

    let shutdown = CancellationToken::new();
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    set_health(&health_reporter, false).await;
    tokio::spawn(follow_engine_health(engine.clone(), health_reporter.clone()));
    tokio::spawn(shut_down_on_signal(
        shutdown.clone(),
        engine.clone(),
        health_reporter,
        Duration::from_secs(config.server.shutdown_timeout_secs),
    ));

    // Each listener advertises only the services it serves.
    let reflection = |service: &str| {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .with_service_name(service)
            .with_service_name("grpc.health.v1.Health")
    };
    let generation_name = <GenerationServer<GenerationService> as tonic::server::NamedService>::NAME;
    let admin_name = <AdminServer<AdminService> as tonic::server::NamedService>::NAME;
    // Both reflection versions: grpcurl speaks v1, grpcio-reflection's client v1alpha.
    let grpc = Server::builder()
        .add_service(health_service.clone())
        .add_service(reflection(generation_name).build_v1()?)
        .add_service(reflection(generation_name).build_v1alpha()?)
        .add_service(GenerationServer::with_interceptor(
            GenerationService::new(front.clone()),
            api_key.grpc_interceptor(),
        ))
        .serve_with_incoming_shutdown(
            // Token messages are small: Nagle would hold each one until the last was acknowledged.
            TcpIncoming::from(grpc_listener).with_nodelay(Some(true)),
            shutdown.clone().cancelled_owned(),
        );
    let admin_key = if config.server.admin_listen.ip().is_loopback() {
        ApiKey::default()
    } else {
        api_key.clone()
    };
    let admin = Server::builder()
        .add_service(health_service)
        .add_service(reflection(admin_name).build_v1()?)
        .add_service(reflection(admin_name).build_v1alpha()?)
        .add_service(AdminServer::with_interceptor(
            AdminService::new(engine.clone()),
            admin_key.grpc_interceptor(),
        ))
        .serve_with_incoming_shutdown(
            TcpIncoming::from(admin_listener).with_nodelay(Some(true)),
            shutdown.clone().cancelled_owned(),
        );
    let http_state = HttpState {
        front,
        api_key,
        created: http::unix_seconds(),
    };
    let http_listener = http_listener.tap_io(|tcp| {
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::debug!(%error, "could not set TCP_NODELAY");
        }
    });
    let http = axum::serve(http_listener, http::router(http_state))
        .with_graceful_shutdown(shutdown.clone().cancelled_owned())
        .into_future();
    let refused_setting = engine.refused_setting.clone();
    drop(engine);
    // One listener failing stops the others; after shutdown began, connections that never end
    // (a health `Watch`, a stalled stream) are cut once the drain time is over.
    let stop_all = |result| {
        shutdown.cancel();
        result
    };
    let servers = async {
        tokio::join!(
            async { stop_all(grpc.await.map_err(anyhow::Error::from)) },
            async { stop_all(admin.await.map_err(anyhow::Error::from)) },
            async { stop_all(http.await.map_err(anyhow::Error::from)) },
        )
    };
    let grace = Duration::from_secs(config.server.shutdown_timeout_secs) + Duration::from_secs(5);
    let cut_off = async {
        shutdown.cancelled().await;
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        (grpc, admin, http) = servers => {
            grpc?;
            admin?;
            http?;
        }
        () = cut_off => tracing::warn!("connections still open after the drain time; closing them"),
    }

    tracing::info!("servers stopped; waiting for the engine to finish");
    // Every engine handle is gone with the services, so the engine stops its workers and exits.
    tokio::task::spawn_blocking(move || engine_thread.join())
        .await?
        .map_err(|_| anyhow::anyhow!("engine thread panicked"))?;
    // The configuration cannot serve: exit as an invalid value at start does, the key named.
    if let Some(refused) = refused_setting.borrow().clone() {
        anyhow::bail!("{refused}");
    }
    Ok(())
}

/// Probes see NOT_SERVING at once; the engine refuses new work and bounds the drain; the
/// listeners stop accepting and finish their open calls. Also when a spawned worker refused a
/// setting (nothing to wait for then), and when a listener failed (the handle must go, or the
/// engine would wait for it).
async fn shut_down_on_signal(
    shutdown: CancellationToken,
    engine: EngineHandle,
    health: HealthReporter,
    timeout: Duration,
) {
    let mut refused = engine.refused_setting.clone();
    let refusal = async move {
        refused
            .wait_for(Option::is_some)
            .await
            .ok()
            .and_then(|error| error.clone())
    };
    let timeout = tokio::select! {
        () = shutdown_signal() => timeout,
        Some(error) = refusal => {
            tracing::error!(%error, "a worker refused a setting; stopping");
            Duration::ZERO
        }
        () = shutdown.cancelled() => timeout,
    };
    set_health(&health, false).await;
    engine.begin_drain(timeout);
    drop(engine);
    shutdown.cancel();
}

/// Health follows the engine: `SERVING` while some replica is ready. Holds only the engine's
/// health watch, not a handle, so it does not keep the engine alive.
fn follow_engine_health(engine: EngineHandle, reporter: HealthReporter) -> impl std::future::Future<Output = ()> {
    let mut serving = engine.serving.clone();
    drop(engine);
    async move {
        loop {
            let now = *serving.borrow_and_update();
            set_health(&reporter, now).await;
            if serving.changed().await.is_err() {
                set_health(&reporter, false).await;
                return;
            }
        }
    }
}

async fn set_health(reporter: &HealthReporter, serving: bool) {
    let status = if serving {
        tonic_health::ServingStatus::Serving
    } else {
        tonic_health::ServingStatus::NotServing
    };
    reporter
        .set_service_status(
            <GenerationServer<GenerationService> as tonic::server::NamedService>::NAME,
            status,
        )
        .await;
    reporter.set_service_status("", status).await;
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
    tracing::info!("shutdown signal received");
}
