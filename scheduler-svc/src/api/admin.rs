//! The `rivulet.v1.Admin` gRPC service: statistics (pooled and per replica), the scheduling
//! policy, the stats window, draining a worker replica, the admission queue.

use rivulet::proto;
use rivulet::proto::admin_server::Admin;
use tonic::{Request, Response, Status};

use super::grpc::engine_status;
use crate::engine::{EngineHandle, QueuedRequest};
use crate::replica::{ReplicaOrigin, ReplicaSnapshot, ReplicaState};
use crate::request::Priority;
use crate::scheduler::SchedulingPolicy;
use crate::stats::StatsSnapshot;

pub struct AdminService {
    engine: EngineHandle,
}

impl AdminService {
    pub fn new(engine: EngineHandle) -> Self {
        Self { engine }
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn get_stats(&self, _: Request<proto::GetStatsRequest>) -> Result<Response<proto::GetStatsResponse>, Status> {
        let stats = self
            .engine
            .stats()
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        Ok(Response::new(proto_stats(&stats)))
    }

    async fn set_scheduling_policy(
        &self,
        request: Request<proto::SetSchedulingPolicyRequest>,
    ) -> Result<Response<proto::SetSchedulingPolicyResponse>, Status> {
        let requested = request.into_inner().policy;
        let policy = match proto::SchedulingPolicy::try_from(requested) {
            Ok(proto::SchedulingPolicy::Fair) => SchedulingPolicy::Fair,
            Ok(proto::SchedulingPolicy::LatencyFirst) => SchedulingPolicy::LatencyFirst,
            Ok(proto::SchedulingPolicy::ThroughputFirst) => SchedulingPolicy::ThroughputFirst,
            Ok(proto::SchedulingPolicy::Unspecified) | Err(_) => {
                return Err(Status::invalid_argument(format!(
                    "policy: {requested} is not FAIR, LATENCY_FIRST or THROUGHPUT_FIRST"
                )))
            }
        };
        let previous = self
            .engine
            .set_policy(policy)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        Ok(Response::new(proto::SetSchedulingPolicyResponse {
            previous: proto_policy(previous) as i32,
        }))
    }

    async fn reset_stats_window(
        &self,
        _: Request<proto::ResetStatsWindowRequest>,
    ) -> Result<Response<proto::ResetStatsWindowResponse>, Status> {
        self.engine
            .reset_stats_window()
            .map_err(|e| Status::unavailable(e.to_string()))?;
        Ok(Response::new(proto::ResetStatsWindowResponse {}))
    }

    async fn drain_worker(
        &self,
        request: Request<proto::DrainWorkerRequest>,
    ) -> Result<Response<proto::DrainWorkerResponse>, Status> {
        self.engine
            .drain_replica(request.into_inner().id)
            .await
            .map_err(engine_status)?;
        Ok(Response::new(proto::DrainWorkerResponse {}))
    }

    async fn get_queue(&self, _: Request<proto::GetQueueRequest>) -> Result<Response<proto::GetQueueResponse>, Status> {
        let queue = self.engine.queue().await.map_err(engine_status)?;
        Ok(Response::new(proto::GetQueueResponse {
            requests: queue.requests.into_iter().map(proto_queued).collect(),
            recommended_max_sequence_length: queue.recommended_max_sequence_length,
        }))
    }

    async fn clear_queue(
        &self,
        _: Request<proto::ClearQueueRequest>,
    ) -> Result<Response<proto::ClearQueueResponse>, Status> {
        let cleared = self.engine.clear_queue().await.map_err(engine_status)?;
        Ok(Response::new(proto::ClearQueueResponse {
            cleared: cleared as u32,
        }))
    }
}

fn proto_queued(request: QueuedRequest) -> proto::QueuedRequest {
    let priority = match request.priority {
        Priority::Low => proto::Priority::Low,
        Priority::Normal => proto::Priority::Normal,
        Priority::High => proto::Priority::High,
        Priority::Critical => proto::Priority::Critical,
    };
    proto::QueuedRequest {
        request_id: request.request_id,
        priority: priority as i32,
        prompt_tokens: request.prompt_tokens,
        waiting_seconds: request.waiting.as_secs_f64(),
        replica: request.replica,
    }
}

fn proto_policy(policy: SchedulingPolicy) -> proto::SchedulingPolicy {
    match policy {
        SchedulingPolicy::Fair => proto::SchedulingPolicy::Fair,
        SchedulingPolicy::LatencyFirst => proto::SchedulingPolicy::LatencyFirst,
        SchedulingPolicy::ThroughputFirst => proto::SchedulingPolicy::ThroughputFirst,
    }
}

fn proto_stats(stats: &StatsSnapshot) -> proto::GetStatsResponse {
    proto::GetStatsResponse {
        total_tokens_generated: stats.total_tokens_generated,
        tokens_per_second: stats.tokens_per_second,
        window_seconds: stats.window_seconds,
        scheduling_policy: proto_policy(stats.policy) as i32,
        num_waiting: stats.num_waiting,
        num_running: stats.num_running,
        kv_blocks_total: stats.kv_blocks_total,
        kv_blocks_used: stats.kv_blocks_used,
        kv_blocks_free: stats.kv_blocks_free,
        kv_blocks_cached: stats.kv_blocks_cached,
        memory_pressure: stats.memory_pressure,
        prefix_cache_hit_rate: stats.prefix_cache_hit_rate,
        num_preemptions: stats.num_preemptions,
        iterations: stats.iterations,
        step_micros_total: stats.step_micros_total,
        worker_forward_micros_total: stats.worker_forward_micros_total,
        scheduler_micros_total: stats.scheduler_micros_total,
        replicas: stats.replicas.iter().map(proto_replica).collect(),
        num_replicas_ready: stats.num_replicas_ready,
    }
}

fn proto_replica(replica: &ReplicaSnapshot) -> proto::ReplicaStats {
    let state = match replica.state {
        ReplicaState::Starting => proto::ReplicaState::Starting,
        ReplicaState::Ready => proto::ReplicaState::Ready,
        ReplicaState::Draining => proto::ReplicaState::Draining,
        ReplicaState::Failed => proto::ReplicaState::Failed,
    };
    proto::ReplicaStats {
        id: replica.id,
        device: replica.device.clone(),
        state: state as i32,
        pid: replica.pid.unwrap_or_default(),
        kv_blocks_total: replica.kv_blocks_total,
        kv_blocks_used: replica.kv_blocks_used,
        num_running: replica.num_running,
        num_waiting: replica.num_waiting,
        steps: replica.steps,
        restarts: replica.restarts,
        attached: replica.origin == ReplicaOrigin::Attached,
        last_error: replica.last_error.clone().unwrap_or_default(),
    }
}
