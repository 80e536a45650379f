//! Assembling and running the gRPC server: the Generation service, the standard health service and
//! server reflection (v1 and v1alpha), with graceful shutdown on SIGINT/SIGTERM. The port opens at once; health
//! says `SERVING` only while some worker replica is ready (requests queue meanwhile).

use std::sync::Arc;

use std::time::Duration;

use rivulet::proto;
use rivulet::proto::admin_server::AdminServer;
use rivulet::proto::generation_server::GenerationServer;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::Server;

use crate::admin::AdminService;
use crate::config::Config;
use crate::engine::{self, EngineHandle};
use crate::model_limits::ModelLimits;
use crate::service::GenerationService;
use crate::tokenizer::ModelTokenizer;

/// Loads the tokenizer, starts the worker and the engine, and serves until a shutdown signal.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let tokenizer = Arc::new(ModelTokenizer::from_model_path(&config.model.path)?);

    let limits = ModelLimits::read(&config.model.path, tokenizer.vocab_size(), config.model.max_model_len)?;
    let (engine, engine_thread) = engine::start(config.clone(), tokenizer.clone(), limits)?;

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    set_health(&health_reporter, false).await;
    tokio::spawn(follow_engine_health(engine.clone(), health_reporter.clone()));
    // Both reflection versions: grpcurl speaks v1, grpcio-reflection's client v1alpha.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection().build_v1()?;
    let reflection_v1alpha = reflection().build_v1alpha()?;

    let listener = tokio::net::TcpListener::bind(config.server.listen).await?;
    let address = listener.local_addr()?;
    // On stdout, for scripts and tests that start the server on port 0.
    println!("rivulet-scheduler listening on {address}");
    tracing::info!(%address, model = %config.model.path.display(), "serving");

    let generation = GenerationService::new(
        engine.clone(),
        tokenizer,
        config.scheduler.default_max_new_tokens,
        config.scheduler.default_stop_strings.clone(),
    );
    let admin = AdminService::new(engine.clone());
    let shutdown_timeout = Duration::from_secs(config.server.shutdown_timeout_secs);
    let shutdown = async move {
        shutdown_signal().await;
        // Probes see NOT_SERVING at once; the engine refuses new work and bounds the drain.
        set_health(&health_reporter, false).await;
        engine.begin_drain(shutdown_timeout);
    };
    Server::builder()
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(GenerationServer::new(generation))
        .add_service(AdminServer::new(admin))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await?;

    tracing::info!("server stopped; waiting for the engine to finish");
    // Every engine handle is gone with the services, so the engine stops its worker and exits.
    tokio::task::spawn_blocking(move || engine_thread.join())
        .await?
        .map_err(|_| anyhow::anyhow!("engine thread panicked"))?;
    Ok(())
}
/// Health follows the engine: `SERVING` while some replica is ready. Holds only the engine's
/// health watch, not a handle, so it does not keep the engine alive.
fn follow_engine_health(
    engine: EngineHandle,
    reporter: tonic_health::server::HealthReporter,
) -> impl std::future::Future<Output = ()> {
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

async fn set_health(reporter: &tonic_health::server::HealthReporter, serving: bool) {
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
