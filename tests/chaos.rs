//! The chaos soak: hundreds of mixed requests against two worker replicas while one worker is
//! SIGKILLed twice and SIGSTOPped once (a hang the step deadline catches), and overload bursts of
//! several times the queue bound. Every call must end with its tokens and a finish reason, or —
//! during a burst only — with `RESOURCE_EXHAUSTED`, refused at once; never `UNAVAILABLE` (the other
//! replica is always up), never hang. Greedy outputs during and after equal transformers';
//! seeded ones equal an undisturbed run's; stop strings trim the text exactly. Afterwards no KV
//! block is held, nothing waits or runs, the scheduler's resident memory is back near where it
//! started, and SIGTERM leaves no shared-memory segment.
//!
//! The client mix and timings come from a seeded RNG (`CHAOS_SEED` replays a run).

mod common;
// The mixed load's calls and their checks (`tests/chaos/` holds no test target of its own).
#[path = "chaos/calls.rs"]
mod calls;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use calls::{make, read_stream, seeded_request, stop_string_within, Call, Expected, Outcome};
use common::{assert_no_blocks_held, greedy_request, reference_tokens, shm_segments, signal, TestServer};
use futures::future::join_all;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rivulet::proto::generation_client::GenerationClient;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

const REFERENCE_TOKENS: u32 = 24;
const SEEDED_TOKENS: u32 = 12;
/// `scheduler.max_queued_requests` of the soak's server; bursts send several times as many.
const QUEUE_BOUND: usize = 12;
const BURST: usize = 4 * QUEUE_BOUND;
/// Concurrent clients of the steady mixed load (fewer than the queue bound: alone, it is never
/// refused).
const CLIENTS: usize = 8;
/// The steady load goes on until the chaos is over and at least this many calls were answered.
const MIN_CALLS: usize = 240;
/// A call still unanswered after this long hangs.
const CALL_DEADLINE: Duration = Duration::from_secs(180);
/// "At once": a refusal slower than this waited for something.
const REFUSAL_DEADLINE: Duration = Duration::from_millis(500);
/// How far the scheduler's resident memory may stay above its warmed-up level.
const RSS_MARGIN_KB: u64 = 16 * 1024;

fn prompts() -> Vec<String> {
    [
        "The capital of France is",
        "Once upon a time, in a small village by the sea,",
        "List three uses of copper:",
        "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
        "def fibonacci(n):\n",
        "A haiku about autumn leaves:",
        "Explain photosynthesis to a child:",
        "SELECT name FROM users WHERE",
        "The Pythagorean theorem states that",
        "Rust's borrow checker ensures that",
    ]
    .iter()
    .map(|p| (*p).to_owned())
    .collect()
}

/// What the soak saw.
#[derive(Default)]
struct Ledger {
    served: usize,
    cancelled: usize,
    refusals: Vec<Duration>,
    broken: Vec<String>,
}

struct Soak {
    client: GenerationClient<Channel>,
    expected: Expected,
    ledger: Mutex<Ledger>,
    /// Bursts in flight (a refusal is only allowed while one is).
    bursting: AtomicUsize,
    chaos_over: AtomicBool,
    /// Calls of the steady load answered (not refused).
    answered: AtomicUsize,
}

impl Soak {
    fn record(&self, call: Call, result: Result<Outcome, String>, during_burst: bool) {
        let mut ledger = self.ledger.lock().expect("ledger");
        match result {
            Ok(Outcome::Served) => ledger.served += 1,
            Ok(Outcome::Cancelled) => ledger.cancelled += 1,
            Ok(Outcome::Refused(latency)) => {
                if !during_burst {
                    ledger.broken.push(format!("{call:?} refused outside a burst"));
                }
                if latency > REFUSAL_DEADLINE {
                    ledger.broken.push(format!("{call:?} refused only after {latency:?}"));
                }
                ledger.refusals.push(latency);
            }
            Err(broken) => ledger.broken.push(broken),
        }
    }

    fn broken(&self, what: String) {
        self.ledger.lock().expect("ledger").broken.push(what);
    }

    fn bursting(&self) -> bool {
        self.bursting.load(Ordering::SeqCst) > 0
    }
}

/// One client of the steady mixed load: one call after another until the chaos is over and
/// enough calls were answered. Refused, it backs off a little, as a real client would.
async fn steady_client(soak: Arc<Soak>, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut client = soak.client.clone();
    while !(soak.chaos_over.load(Ordering::SeqCst) && soak.answered.load(Ordering::SeqCst) >= MIN_CALLS) {
        let call = Call::random(&mut rng, soak.expected.prompts.len());
        let burst_before = soak.bursting();
        let result = make(&mut client, call, &soak.expected).await;
        let refused = matches!(result, Ok(Outcome::Refused(_)));
        soak.record(call, result, burst_before || soak.bursting());
        if refused {
            tokio::time::sleep(Duration::from_millis(rng.random_range(50..250))).await;
        } else {
            soak.answered.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Sends `BURST` short calls at once while an admitted stream is running; the stream must keep
/// receiving tokens while the burst is refused, and some of the burst must be refused.
async fn burst(soak: &Soak, rng: &mut StdRng) {
    let prompts = soak.expected.prompts.len();
    let observed = rng.random_range(0..prompts);
    let mut client = soak.client.clone();
    let request = greedy_request(&soak.expected.prompts[observed], REFERENCE_TOKENS);
    let mut observer = client
        .stream_generate(request)
        .await
        .expect("observer stream")
        .into_inner();
    let mut tokens = observer.next().await.expect("a first message").expect("ok").token_ids;
    soak.bursting.fetch_add(1, Ordering::SeqCst);
    let start = Instant::now();
    let observer = tokio::spawn(async move {
        let mut arrivals = Vec::new();
        while let Some(message) = observer.next().await {
            tokens.extend(message?.token_ids);
            arrivals.push(Instant::now());
        }
        Ok::<_, tonic::Status>((tokens, arrivals))
    });
    let calls: Vec<Call> = (0..BURST)
        .map(|_| Call::GreedyUnary {
            prompt: rng.random_range(0..prompts),
            tokens: 4,
        })
        .collect();
    let results = join_all(calls.iter().map(|&call| {
        let mut client = soak.client.clone();
        async move { make(&mut client, call, &soak.expected).await }
    }))
    .await;
    let end = Instant::now();
    soak.bursting.fetch_sub(1, Ordering::SeqCst);
    let refusals: Vec<Duration> = results
        .iter()
        .filter_map(|r| match r {
            Ok(Outcome::Refused(latency)) => Some(*latency),
            _ => None,
        })
        .collect();
    let refused = refusals.len();
    // The burst's calls all start at `start`: the first refusal came back this much later.
    let first_refused = start + refusals.iter().min().copied().unwrap_or_default();
    if refused == 0 {
        soak.broken(format!(
            "a burst of {BURST} over a queue bound of {QUEUE_BOUND} was not refused at all"
        ));
    }
    for (call, result) in calls.into_iter().zip(results) {
        soak.record(call, result, true);
    }
    match observer.await.expect("observer task") {
        Ok((tokens, arrivals)) => {
            if tokens != soak.expected.greedy[observed] {
                soak.broken(format!("the stream beside a burst: {tokens:?}"));
            }
            if !arrivals.iter().any(|at| (first_refused..=end).contains(at)) {
                soak.broken("the stream beside a burst received nothing once the burst was refused".to_owned());
            }
        }
        Err(status) => soak.broken(format!("the stream beside a burst failed: {status:?}")),
    }
    eprintln!("chaos: burst of {BURST}: {refused} refused, {:?}", end - start);
}

/// Waits until both replicas are ready and at least `restarts` workers were replaced in all (the
/// exact count is asserted at the end, with the stats in the message).
async fn both_ready_after(server: &TestServer, restarts: u32) {
    common::wait_until(Duration::from_secs(300), "both replicas ready", || async {
        let stats = server.stats().await;
        stats.num_replicas_ready == 2 && stats.replicas.iter().map(|r| r.restarts).sum::<u32>() >= restarts
    })
    .await;
}

/// Sends `sig` to the worker of the replica holding the most sequences (once one holds any).
async fn disturb_busiest_worker(server: &TestServer, sig: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let victim = loop {
        let stats = server.stats().await;
        let busiest = stats
            .replicas
            .iter()
            .filter(|r| r.pid != 0 && r.num_running + r.num_waiting > 0)
            .max_by_key(|r| r.num_running + r.num_waiting)
            .map(|r| (r.pid, r.num_running + r.num_waiting));
        match busiest {
            Some(victim) => break victim,
            None if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
            None => panic!("no replica held a sequence for a minute: {stats:?}"),
        }
    };
    let (pid, sequences) = victim;
    eprintln!("chaos: SIG{sig} to worker {pid} holding {sequences} sequences");
    signal(pid, sig);
}

/// The chaos: bursts, two SIGKILLs and a SIGSTOP of a worker, at random moments.
async fn chaos(soak: &Soak, server: &TestServer, rng: &mut StdRng) {
    let pause = |rng: &mut StdRng| tokio::time::sleep(Duration::from_millis(rng.random_range(500..3000)));
    pause(rng).await;
    burst(soak, rng).await;
    for (restarts, sig) in [(1, "KILL"), (2, "KILL"), (3, "STOP")] {
        pause(rng).await;
        disturb_busiest_worker(server, sig).await;
        if restarts == 2 {
            burst(soak, rng).await;
        }
        both_ready_after(server, restarts).await;
    }
    pause(rng).await;
    burst(soak, rng).await;
    soak.chaos_over.store(true, Ordering::SeqCst);
}

/// The resident memory of process `pid`, in KiB.
fn resident_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

#[tokio::test(flavor = "multi_thread")]
async fn under_kills_a_hang_and_overload_bursts_every_call_ends_well_and_nothing_leaks() {
    let seed = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(7, |d| d.as_secs())
        });
    eprintln!("chaos: seed {seed} (CHAOS_SEED={seed} replays the mix)");
    let test_started = Instant::now();
    let segments_before = shm_segments();
    let mut server = TestServer::start(&[
        ("RIVULET_WORKER__REPLICAS", "2"),
        ("RIVULET_WORKER__STEP_TIMEOUT_SECS", "10"),
        ("RIVULET_SCHEDULER__MAX_QUEUED_REQUESTS", &QUEUE_BOUND.to_string()),
    ]);
    let prompts = prompts();
    let greedy = reference_tokens(&prompts, REFERENCE_TOKENS).await;
    let client = server.client().await;
    both_ready_after(&server, 0).await;

    // Undisturbed runs (concurrent: a crowd does not change greedy or seeded tokens): the greedy
    // text, where the stop strings come from, and the seeded tokens.
    let undisturbed = join_all(prompts.iter().enumerate().map(|(index, prompt)| {
        let mut client = client.clone();
        async move {
            let greedy = client.generate(greedy_request(prompt, REFERENCE_TOKENS)).await;
            let seeded = client.generate(seeded_request(prompt, index)).await;
            (
                greedy.expect("greedy").into_inner(),
                seeded.expect("seeded").into_inner(),
            )
        }
    }))
    .await;
    let (mut seeded, mut stop) = (Vec::new(), Vec::new());
    for ((prompt, (greedy_run, seeded_run)), want) in prompts.iter().zip(undisturbed).zip(&greedy) {
        assert_eq!(&greedy_run.token_ids, want, "undisturbed greedy, prompt {prompt:?}");
        stop.push(stop_string_within(&greedy_run.text));
        seeded.push(seeded_run.token_ids);
    }
    eprintln!(
        "chaos: references and undisturbed runs after {:?}",
        test_started.elapsed()
    );
    assert_no_blocks_held(&server).await;
    let resident_before = resident_kb(server.pid());

    let started = Instant::now();
    let soak = Arc::new(Soak {
        client: client.clone(),
        expected: Expected {
            prompts: prompts.clone(),
            greedy: greedy.clone(),
            seeded,
            stop,
        },
        ledger: Mutex::default(),
        bursting: AtomicUsize::new(0),
        chaos_over: AtomicBool::new(false),
        answered: AtomicUsize::new(0),
    });
    let clients: Vec<_> = (0..CLIENTS as u64)
        .map(|i| tokio::spawn(steady_client(soak.clone(), seed.wrapping_add(i + 1))))
        .collect();
    chaos(&soak, &server, &mut StdRng::seed_from_u64(seed)).await;
    for client in clients {
        client.await.expect("steady client");
    }
    let elapsed = started.elapsed();
    {
        let ledger = soak.ledger.lock().expect("ledger");
        let mut refusals = ledger.refusals.clone();
        refusals.sort();
        eprintln!(
            "chaos: {} calls answered in the steady load, and bursts, in {elapsed:?}: {} served, {} cancelled, \
             {} refused (median {:?}, slowest {:?})",
            soak.answered.load(Ordering::SeqCst),
            ledger.served,
            ledger.cancelled,
            refusals.len(),
            refusals.get(refusals.len() / 2),
            refusals.last(),
        );
        assert!(
            ledger.broken.is_empty(),
            "{} broken promises: {:#?}",
            ledger.broken.len(),
            ledger.broken
        );
        assert!(
            ledger.served >= MIN_CALLS / 2 && ledger.cancelled > 0,
            "a mixed load ran"
        );
    }

    // After the chaos: both replicas back, the reference's tokens, nothing held.
    both_ready_after(&server, 3).await;
    let stats = server.stats().await;
    let restarts: u32 = stats.replicas.iter().map(|r| r.restarts).sum();
    assert_eq!(restarts, 3, "two kills and one hang, nothing else: {stats:?}");
    let after = join_all(prompts.iter().map(|prompt| {
        let mut client = client.clone();
        async move { read_stream(&mut client, greedy_request(prompt, REFERENCE_TOKENS)).await }
    }))
    .await;
    for ((prompt, output), want) in prompts.iter().zip(after).zip(&greedy) {
        assert_eq!(
            &output.expect("served after the chaos").0,
            want,
            "after the chaos, {prompt:?}"
        );
    }
    assert_no_blocks_held(&server).await;
    let resident_after = resident_kb(server.pid());
    eprintln!("chaos: scheduler resident memory {resident_before} KiB before, {resident_after} KiB after");
    assert!(
        resident_after <= resident_before + RSS_MARGIN_KB,
        "the scheduler's memory grew from {resident_before} KiB to {resident_after} KiB"
    );

    eprintln!("chaos: checked after {:?}", test_started.elapsed());
    let status = server.terminate();
    assert!(status.success(), "clean exit after SIGTERM: {status:?}");
    let left: Vec<_> = shm_segments().difference(&segments_before).cloned().collect();
    assert!(left.is_empty(), "shared memory left behind: {left:?}");
    eprintln!("chaos: stopped after {:?}", test_started.elapsed());
}
