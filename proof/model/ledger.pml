/*
 * sekali's ledger protocol, one intent (key K = payment:o1, request R), at the grain of its
 * atomic steps: each `atomic` block is one SQL statement or transaction, one Lua script, or one
 * check-and-act in Python, and is named (STEP labels, README.md's table) after the code that
 * does it. Everything between two blocks may interleave with every other actor, and the clock
 * may run for any time: a pause is a worker that is not scheduled.
 *
 * Actors: NW workers running deliveries of R (per-request runs, micro-batch members, replays),
 * each with the lease keeper thread of its claim (maybe_beat); a broker that redelivers R (concurrent or
 * late); a killer that ends a worker at any step; the ledger (idempotency_records), the order
 * row (orders), the request row (job_requests) and its DLQ record; a payment gateway that
 * ignores idempotency keys, takes up to P ticks to commit a charge, can drop its answer, and
 * is looked up by reference; a canceller; an operator who replays the DLQ record; the clock.
 *
 * Time: one clock in ticks (the store's and the workers' agree; a takeover may judge expiry
 * SKEW ticks early). Every stored time is kept as the ticks left until it passes (a lease's
 * expiry, a send bound, a settle window, the provider's deadline), counted down by each tick
 * and 0 once passed: time is unbounded, the state space finite.
 *
 * Broken variants (each must be refuted): NO_FENCE_CHECK, NO_SEND_BOUND, RESEND_NO_LOOKUP,
 * NO_SETTLE_WAIT. The code before the two findings were fixed (README.md, "Findings"), also
 * refuted: OLD_SEND_BOUND (the send bound counted from the confirmation alone, not capped at
 * the send's stamp), OLD_CANCEL_AT_ONCE (a pending or failed request cancelled at once though a
 * live holder holds its key), OLD_CANCEL_POINT (the cancel point before a downstream call
 * skipped for an earlier attempt's recovery point). Scope switches: NO_CANCEL, NO_BATCH,
 * BATCH_REDELIVERY, PROGRESS (the LTL claim). The Redis fence is in
 * redis_fence.pml; runner.py holds the checks, README.md maps every step to its code.
 */

/* ---- parameters (overridable with -D) ---- */
#ifndef NW
#define NW 2            /* worker processes (the model is written for two) */
#endif
#ifndef L
#define L 3             /* lease, ticks */
#endif
#ifndef B
#define B 1             /* send bound: 0.4 L (rounded down) after a confirmation, and after
                         * the send's stamp (JobContext.stamp_send) */
#endif
#ifndef P
#define P 1             /* the provider's longest processing time */
#endif
#ifndef W
#define W (P + B)       /* the settle window the docs ask: longer than 0.4 L plus the
                         * provider's longest processing time */
#endif
#ifndef SKEW
#define SKEW 0          /* how much earlier the taking-over worker's clock judges expiry */
#endif
#ifndef MAXA
#define MAXA 2          /* attempts of one delivery (RetryPolicy), per-request runs */
#endif
#ifndef SEND_TRIES
#define SEND_TRIES 2    /* engine.context.SEND_TRIES (3 in the code) */
#endif
#ifndef LIMIT
#define LIMIT 1         /* SEKALI_CRASH_LOOP_LIMIT (3 in the code) */
#endif
#ifndef MAX_KILLS
#define MAX_KILLS 2     /* workers killed (SIGKILL, a run that dies) */
#endif
#ifndef MAX_LOST
#define MAX_LOST 1      /* answers the gateway never gives (timeout, reset, lost) */
#endif
#ifndef MAX_REDELIVER
#define MAX_REDELIVER 1 /* deliveries of R beyond the first (broker, run retries) */
#endif
#ifndef MAX_REPLAY
#define MAX_REPLAY 1    /* operator replays of the DLQ record */
#endif


/* ---- the ledger: idempotency_records (resources/idempotency/) ---- */
mtype = { ABSENT, INP, COMPLETED, FAILED, RETRYABLE };                  /* Status */
mtype l_status = ABSENT;
byte l_fence = 0;       /* also the owner token: every claim takes a new fence */
byte l_left = 0;        /* ticks until lease_expires_at (0: expired, or no lease) */
bit  l_rp = 0;          /* recovery_point: a checkpoint was written (charge_sent / charged) */
byte l_crashes = 0;
bit  l_solo = 0;        /* solo_fence = fence: the holder ran its handler alone */

/* ---- the order row: orders (pipelines/jobs/payment.py) ---- */
mtype = { O_ABSENT, O_PENDING, O_CNC, O_PAID, O_FAILED };               /* PaymentStatus */
mtype o_status = O_ABSENT;
bit  o_charge = 0;      /* charge_id recorded */
bit  o_sent = 0;        /* charge_sent_at is set */
byte o_settle = 0;      /* ticks until charge_sent_at + the settle window */
byte o_fence = 0;       /* payment_fence */

/* ---- the request row: job_requests, request_cancels (engine/requests/) ---- */
mtype = { R_PENDING, R_RUNNING, R_COMPLETED, R_FAILED, R_CANCELLED };  /* RequestStatus */
mtype = { C_NONE, C_REQUESTED, C_CANCELLED, C_REFUSED };                /* CancelState */
mtype r_status = R_PENDING;
mtype r_cancel = C_NONE;
byte r_by = 0;          /* the run that took the row last (run_id) */

/* ---- the DLQ record (resources/dlq/store.py) ---- */
mtype = { D_NONE, D_OPEN, D_REPLAY, D_RESOLVED, D_CLOSED };
mtype dlq = D_NONE;

/* ---- the gateway: charges it committed, requests in flight, answers ---- */
mtype = { A_NONE, A_CHARGED, A_NOTCH };
byte charges = 0;                       /* effects, counted at the downstream */
#define NFL 2
bit  fl_used[NFL];                      /* a charge request in flight */
byte fl_left[NFL];                      /* ticks left to the provider to commit or refuse it */
byte fl_own[NFL];                       /* worker waiting for its answer, + 1 (0: nobody) */
mtype w_ans[NW];

/* ---- deliveries and the workers' shared view ---- */
mtype = { SOLO, BATCH, REPLAY };        /* per-request run, micro-batch member, DLQ replay */
chan deliveries = [3] of { mtype, byte };   /* mode, run (1 intake, 2 broker, 3 replay) */
bit  kill[NW];
byte kills = 0, lost = 0, redelivered = 0, replays = 0;
bit  busy[NW];
byte w_fence[NW];                       /* the fence of the claim the worker holds (0: none) */
byte k_left[NW];                        /* ticks until LeaseKeeper.expires, the expiry it confirmed */
bit  k_lost[NW];                        /* LeaseKeeper.lost */
byte b_left[NW];                        /* ticks until the send bound confirm_lease returned */
byte s_left[NW];                        /* ticks until the send's stamp + 0.4 L (stamp_send) */
bit  w_sent[NW];                        /* lock_order read a charge_sent_at */
byte w_settle[NW];                      /* ticks until it settles, as read */
bit  started = 0;                       /* init has delivered R */
bit  replay_of_completed = 0;           /* the operator replayed R while K was completed */

#define decided (r_status == R_COMPLETED || r_status == R_CANCELLED || \
                 (r_status == R_FAILED && dlq == D_OPEN))

/* One tick of the clock: every timer counts down. The provider answers every request in
 * flight within P ticks, so the clock waits for it. */
#define down(t) if :: t > 0 -> t-- :: else -> skip fi
#define can_tick (!(fl_used[0] && fl_left[0] == 0) && !(fl_used[1] && fl_left[1] == 0))

active proctype Clock() {
end_clock:
    do
    :: atomic { can_tick ->
        down(l_left); down(o_settle); down(fl_left[0]); down(fl_left[1]);
        down(k_left[0]); down(k_left[1]); down(b_left[0]); down(b_left[1]);
        down(s_left[0]); down(s_left[1]);
        down(w_settle[0]); down(w_settle[1]);
        printf("TICK\n") }
    od
}

#define gateway_commit(k) \
    charges++; \
    printf("EV gateway commits a charge under the order's reference (charges=%d)\n", \
           charges); \
    assert(charges <= 1);   /* P1: at most one effect per intent at the downstream */ \
    if :: fl_own[k] > 0 -> w_ans[fl_own[k] - 1] = A_CHARGED :: else -> skip fi; \
    fl_used[k] = 0; fl_left[k] = 0; fl_own[k] = 0

#define gateway_refuse(k) \
    printf("EV gateway refuses a charge (503): nothing charged\n"); \
    if :: fl_own[k] > 0 -> w_ans[fl_own[k] - 1] = A_NOTCH :: else -> skip fi; \
    fl_used[k] = 0; fl_left[k] = 0; fl_own[k] = 0

active proctype Gateway() {
end_gateway:
    do
    :: atomic { fl_used[0] -> gateway_commit(0) }
    :: atomic { fl_used[1] -> gateway_commit(1) }
    :: atomic { fl_used[0] -> gateway_refuse(0) }
    :: atomic { fl_used[1] -> gateway_refuse(1) }
    od
}

/* The broker / intake: R delivered again, while a delivery runs or after (at-least-once). */
active proctype Broker() {
end_broker:
    do
    :: atomic { redelivered < MAX_REDELIVER && r_status != R_COMPLETED ->
STEP_redeliver:
        redelivered++;
        if
#ifndef BATCH_REDELIVERY
        :: deliveries!SOLO, 2; printf("EV broker delivers R again (per-request run)\n")
#endif
#ifndef NO_BATCH
        :: deliveries!BATCH, 2; printf("EV broker delivers R again (micro-batch)\n")
#endif
        fi }
    od
}

/* SIGKILL of a busy worker at any step. */
active proctype Killer() {
end_killer:
    do
    :: atomic { kills < MAX_KILLS && busy[0] && !kill[0] -> kills++; kill[0] = 1 }
    :: atomic { kills < MAX_KILLS && busy[1] && !kill[1] -> kills++; kill[1] = 1 }
    od
}

/* RequestStore.cancel (engine/requests/cancels.py): one transaction holding the row. A request not
 * running (pending, failed) is cancelled at once, unless a live holder holds its key in the
 * ledger (IdempotencyStore.held: in_progress, lease not run out, judged as a takeover judges
 * it): then the cancel is only requested. OLD_CANCEL_AT_ONCE: the code before, at once. */
#ifdef OLD_CANCEL_AT_ONCE
#define key_held (false)
#else
#define key_held (l_status == INP && l_left > SKEW)
#endif
active proctype Canceller() {
#ifndef NO_CANCEL
    STEP_cancel:
    atomic {
        if
        :: (r_cancel == C_CANCELLED || r_cancel == C_REFUSED ||
            (r_cancel == C_REQUESTED && (r_status == R_RUNNING || key_held))) -> skip
        :: else ->
            if
            :: (r_status == R_PENDING || r_status == R_FAILED) && !key_held ->
                r_status = R_CANCELLED; r_cancel = C_CANCELLED;
                if :: dlq == D_OPEN -> dlq = D_CLOSED :: else -> skip fi;  /* _close_dead_letters */
                printf("EV operator cancels R: not running, cancelled at once\n")
            :: r_status == R_RUNNING || ((r_status == R_PENDING || r_status == R_FAILED) &&
                                         key_held) ->
                r_cancel = C_REQUESTED;
                printf("EV operator cancels R: running or its key held, cancel requested\n")
            :: else ->
                r_cancel = C_REFUSED;
                printf("EV operator cancels R: refused (it completed)\n")
            fi
        fi }
#else
    skip
#endif
}

/* DlqStore.request_replay + IdempotencyStore.reset, then the replay sensor's run. */
active proctype Operator() {
end_operator:
    do
    :: atomic { dlq == D_OPEN && replays < MAX_REPLAY ->
STEP_request_replay:
        replays++; dlq = D_REPLAY;
        if :: l_status == COMPLETED -> replay_of_completed = 1 :: else -> skip fi;
        if :: l_status == FAILED -> l_status = RETRYABLE; l_crashes = 0 :: else -> skip fi;
        deliveries!REPLAY, 3;
        printf("EV operator replays the DLQ record (key reset: %e)\n", l_status) }
    od
}

/* Nothing lost: when no worker is busy and no delivery is queued, nothing will ever run R
 * again, so R must be decided (completed, cancelled, or failed with an open DLQ record). */
active proctype Monitor() {
end_monitor:
    atomic { (started && len(deliveries) == 0 && busy[0] == 0 && busy[1] == 0 && !decided &&
              !(dlq == D_REPLAY)) ->
        printf("EV R is %e with no worker and no delivery left (DLQ %e)\n", r_status,
               dlq);
        assert(false) }     /* P2: no request ends without a decision */
}

/* P8: progress. Once the faults stop (each is bounded), every request ends decided, under weak
 * fairness (pan -a -f): a worker that can go on eventually does. */
#ifdef PROGRESS
ltl progress { <>[] decided }
#endif

/* A business write guarded by the claim's fence: engine.contract.fenced_update. */
#ifdef NO_FENCE_CHECK
#define fence_ok (true)
#else
#define fence_ok (o_fence <= w_fence[i])
#endif
#define fenced_write_asserts \
    if \
    :: w_fence[i] < o_fence -> \
        printf("EV w%d writes the order with fence %d, below the row's %d\n", i, w_fence[i], \
               o_fence) \
    :: else -> skip \
    fi; \
    assert(w_fence[i] >= o_fence)   /* P3: no business write by a holder with a stale fence */

/* The owner's conditional writes: owner_check (queries.sql) = key, owner_token,
 * status = in_progress. */
#define owner_ok (l_status == INP && l_fence == w_fence[i])
/* LeaseKeeper.check: lost, or the expiry it last confirmed has passed. */
#define lease_ok (!k_lost[i] && k_left[i] > 0)

mtype = { E_NONE, E_LEASE_LOST, E_TRANSIENT, E_PERMANENT, E_CANCELLED, E_FENCED, E_DEADLINE,
          E_NOTCH, E_DONE, E_DUPLICATE, E_SKIPPED };

/* LeaseKeeper.check / JobContext.check_lease (the first thing ctx.locked_row does) */
#define check_lease_fails (!lease_ok)
#define say_lease_lost \
    printf("EV w%d check_lease: LeaseLost (fence %d, confirmed for %d more ticks)\n", i, \
           w_fence[i], k_left[i])

/* JobContext.cancel_point: not once this attempt may have sent, nor after a recovery point */
#define cancel_asked (!sent && !rp && (r_cancel == C_REQUESTED || r_cancel == C_CANCELLED))
/* confirm_lease's cancel point, right before a downstream call (_stop_if_cancelled): skipped
 * only once this attempt may have sent, not for an earlier attempt's recovery point (an
 * earlier send that settled unfound is no effect under way). OLD_CANCEL_POINT: the code
 * before, skipped for a recovery point too. */
#ifdef OLD_CANCEL_POINT
#define cancel_before_send cancel_asked
#else
#define cancel_before_send (!sent && (r_cancel == C_REQUESTED || r_cancel == C_CANCELLED))
#endif

/* LeaseKeeper._beat: the keeper thread heartbeats (heartbeat, conditional on the owner) while
 * the expiry it last confirmed has not passed. It may beat at any time; a beat matters only
 * to the checks after it, so the model lets it beat right before the holder's next check. */
#define maybe_beat \
    if \
    :: atomic { lease_ok -> \
        if \
        :: owner_ok -> l_left = L; k_left[i] = L; \
            printf("EV w%d keeper: heartbeat, lease for %d ticks\n", i, l_left) \
        :: else -> k_lost[i] = 1; \
            printf("EV w%d keeper: heartbeat refused (taken over)\n", i) \
        fi } \
    :: skip \
    fi

/* _set_payment(..., "record_not_charged"): locked_row (check_lease), a fenced write with no
 * owner check (payment.py) */
#define record_not_charged \
    atomic { \
        if \
        :: check_lease_fails -> err = E_LEASE_LOST; say_lease_lost \
        :: !check_lease_fails && fence_ok -> \
            fenced_write_asserts; \
            o_status = O_PENDING; o_sent = 0; o_settle = 0; o_fence = w_fence[i]; \
            printf("EV w%d record_not_charged: order back to payment_pending (fence %d)\n", \
                   i, w_fence[i]) \
        :: !check_lease_fails && !fence_ok -> err = E_FENCED; \
            printf("EV w%d record_not_charged: FencedWriteRejected (fence %d < %d)\n", \
                   i, w_fence[i], o_fence) \
        fi }

proctype Worker(byte i) {
    mtype mode = SOLO;
    mtype err = E_NONE;
    mtype cause = E_NONE;
    byte attempt = 0;       /* Dagster's retry_number */
    bit  claimed = 0;
    bit  takeover = 0;      /* Claim.takeover */
    bit  rp = 0;            /* Claim.recovery_point is set */
    bit  sent = 0;          /* JobContext._sent */
    bit  charged = 0;       /* a charge is known (answered, or found by lookup) */
    byte tries = 0;
    byte k = 0;
    byte rrun = 0;          /* the run this delivery belongs to */

end_idle:
    do
    :: atomic { deliveries?mode, rrun -> busy[i] = 1; attempt = 0 };
        {
            skip;
mark_running:
STEP_mark_running:  /* RequestStore.mark_running: the request row's conditional claim */
            atomic {
                err = E_NONE; cause = E_NONE; claimed = 0; takeover = 0; rp = 0; sent = 0;
                charged = 0; tries = 0;
                if
                :: r_status == R_PENDING || r_status == R_RUNNING || r_status == R_FAILED ->
                    r_status = R_RUNNING; r_by = rrun;
                    printf("EV w%d takes R (%e delivery of run %d, attempt %d): running\n",
                           i, mode, rrun, attempt)
                :: r_status == R_CANCELLED ->
                    printf("EV w%d: R is cancelled, nothing runs\n", i);
                    err = E_SKIPPED
                :: else -> skip     /* completed: it runs on and finds the key completed */
                fi }
            if :: err == E_SKIPPED -> goto run_end :: else -> skip fi;

STEP_begin:         /* IdempotencyStore.begin (one conditional upsert, claim), then
                     * check_crash_loop, keep_alive, cancel_point("start") */
            atomic {
                if
                :: l_status == ABSENT ->
                    l_status = INP; l_fence = 1; l_left = L;
                    l_solo = (mode != BATCH); claimed = 1
                :: (l_status == RETRYABLE || (l_status == INP && l_left <= SKEW)) ->
                    takeover = (l_status == INP);
                    if :: (l_status == INP && l_solo) -> l_crashes++ :: else -> skip fi;
                    l_status = INP; l_fence++; l_left = L;
                    l_solo = (mode != BATCH); claimed = 1
                :: l_status == COMPLETED -> err = E_DUPLICATE
                :: l_status == FAILED -> err = E_PERMANENT      /* StoredFailure */
                :: else -> err = E_TRANSIENT                    /* AlreadyInProgress */
                fi;
                if
                :: claimed ->
                    w_fence[i] = l_fence; rp = l_rp; k_left[i] = l_left; k_lost[i] = 0;
                    printf("EV w%d begin: claims K with fence %d (takeover %d), lease for %d ticks\n",
                           i, l_fence, takeover, l_left);
                    if
                    :: l_crashes > LIMIT ->                     /* check_crash_loop */
                        err = E_PERMANENT;
                        printf("EV w%d check_crash_loop: CrashLoop (%d crashes)\n", i,
                               l_crashes)
                    :: else ->
                        if
                        :: cancel_asked -> err = E_CANCELLED;   /* cancel_point("start") */
                            printf("EV w%d cancel_point(start): RequestCancelled\n", i)
                        :: else -> skip
                        fi
                    fi
                :: err == E_TRANSIENT ->
                    printf("EV w%d begin: AlreadyInProgress (another holder's lease is live)\n", i)
                :: err == E_PERMANENT -> printf("EV w%d begin: StoredFailure\n", i)
                :: err == E_DUPLICATE ->
                    printf("EV w%d begin: K completed, a suppressed duplicate\n", i)
                fi }
            if
            :: err == E_DUPLICATE -> goto completed
            :: err != E_NONE -> goto failed
            :: else -> skip
            fi;
#ifndef NO_BATCH
            if
            :: mode == BATCH && takeover ->
STEP_run_alone:     /* IdempotencyStore.run_alone: a suspect runs alone (execute_batch) */
                atomic {
                    if
                    :: owner_ok -> l_solo = 1
                    :: else -> err = E_LEASE_LOST
                    fi }
                if :: err != E_NONE -> goto failed :: else -> skip fi
            :: else -> skip
            fi;
#endif

            /* ---- the handler: charge_payment (pipelines/jobs/payment.py) ---- */
STEP_check_lease:   /* locked_row("lock_order") checks the lease, then opens the transaction */
            atomic {
                if
                :: check_lease_fails -> err = E_LEASE_LOST; say_lease_lost
                :: else -> printf("EV w%d check_lease: the lease holds, opens the transaction\n", i)
                fi }
            if :: err != E_NONE -> goto failed :: else -> skip fi;
STEP_lock_order:
            atomic {
                if
                :: o_status == O_ABSENT ->
                    o_status = O_PENDING; o_fence = w_fence[i]; w_sent[i] = 0; w_settle[i] = 0;
                    printf("EV w%d lock_order: order created, payment_pending (fence %d)\n",
                           i, w_fence[i])
                :: o_status == O_PAID ->                        /* ctx.complete in the txn */
                    if
                    :: owner_ok -> l_status = COMPLETED; l_left = 0; err = E_DONE;
                        printf("EV w%d lock_order: order paid, completes K\n", i)
                    :: else -> err = E_LEASE_LOST
                    fi
                :: o_status != O_ABSENT && o_status != O_PAID && fence_ok ->
                    fenced_write_asserts;
                    o_fence = w_fence[i]; charged = o_charge;
                    if
                    :: o_status == O_CNC && !o_charge -> w_sent[i] = 1; w_settle[i] = o_settle
                    :: else -> w_sent[i] = 0; w_settle[i] = 0
                    fi;
                    printf("EV w%d lock_order: order %e, charge recorded %d, sent unanswered %d (fence %d)\n",
                           i, o_status, o_charge, o_sent, w_fence[i])
                :: o_status != O_ABSENT && o_status != O_PAID && !fence_ok -> err = E_FENCED;
                    printf("EV w%d lock_order: FencedWriteRejected (fence %d < %d)\n", i,
                           w_fence[i], o_fence)
                fi }
            if
            :: err == E_DONE -> goto completed
            :: err != E_NONE -> goto failed
            :: charged -> goto record_charge
            :: else -> skip
            fi;
            if
            :: w_sent[i] ->                          /* an earlier send, unanswered */
STEP_settle_lookup: /* PaymentNotSettled until sent_at + settle window, then _lookup */
                atomic {
#ifndef NO_SETTLE_WAIT
                    if
                    :: w_settle[i] > 0 -> err = E_TRANSIENT;
                        printf("EV w%d PaymentNotSettled: the unanswered send settles in %d ticks\n",
                               i, w_settle[i])
                    :: else -> skip
                    fi;
#endif
                    w_sent[i] = 0; w_settle[i] = 0;
#ifndef RESEND_NO_LOOKUP
                    if
                    :: err == E_NONE -> charged = (charges > 0);
                        printf("EV w%d looks the charge up by reference: found %d\n", i,
                               charged)
                    :: else -> skip
                    fi
#endif
                }
                if :: err != E_NONE -> goto failed :: else -> skip fi
            :: else ->
                if
                :: (w_fence[i] > 1 || takeover) ->             /* claim.attempt > 1 */
STEP_lookup:        /* _lookup: gateway.find_charges(reference) before a retry's first send */
                    atomic {
                        charged = (charges > 0);
                        printf("EV w%d looks the charge up by reference: found %d\n", i, charged)
                    }
                :: else -> skip
                fi
            fi;
            if
            :: charged -> goto record_charge
            :: else -> skip
            fi;

            /* ---- _send_charge ---- */
send_try:
            maybe_beat;
STEP_record_send:   /* ctx.stamp_send(), then locked_row (check_lease), fenced_update +
                     * ctx.checkpoint(CHARGE_SENT), one transaction */
            atomic {
                if
                :: check_lease_fails -> err = E_LEASE_LOST; say_lease_lost
                :: !check_lease_fails && !fence_ok -> err = E_FENCED;
                    printf("EV w%d record_send: FencedWriteRejected\n", i)
                :: !check_lease_fails && fence_ok && cancel_asked -> err = E_CANCELLED;
                    printf("EV w%d record_send: cancel_point: RequestCancelled, rolled back\n",
                           i)
                :: !check_lease_fails && fence_ok && !cancel_asked && !owner_ok ->
                    err = E_LEASE_LOST;
                    printf("EV w%d record_send: checkpoint LeaseLost, rolled back\n", i)
                :: !check_lease_fails && fence_ok && !cancel_asked && owner_ok ->
                    fenced_write_asserts;
                    o_status = O_CNC; o_charge = 0; o_sent = 1; o_settle = W; o_fence = w_fence[i];
                    s_left[i] = B; l_rp = 1; l_left = L;
                    printf("EV w%d record_send: charged_not_confirmed, charge_sent_at now (fence %d)\n",
                           i, w_fence[i])
                fi }
            if :: err != E_NONE -> goto failed :: else -> skip fi;

STEP_confirm_lease: /* JobContext.confirm_lease: check_lease, _stop_if_cancelled, _sent = True,
                     * asked = now, LeaseKeeper.confirm (heartbeat, owner); bound asked + 0.4 L,
                     * capped at the send's stamp + 0.4 L */
            atomic {
                if
                :: check_lease_fails -> err = E_LEASE_LOST; say_lease_lost
                :: !check_lease_fails && cancel_before_send -> err = E_CANCELLED;
                    printf("EV w%d confirm_lease: cancel_point: RequestCancelled\n", i)
                :: !check_lease_fails && !cancel_before_send && owner_ok ->
                    sent = 1; l_left = L; k_left[i] = L;
#ifdef OLD_SEND_BOUND
                    b_left[i] = B;
#else
                    if :: s_left[i] < B -> b_left[i] = s_left[i] :: else -> b_left[i] = B fi;
#endif
                    printf("EV w%d confirm_lease: heartbeat, lease for %d ticks, send bound in %d\n",
                           i, l_left, b_left[i])
                :: !check_lease_fails && !cancel_before_send && !owner_ok ->
                    sent = 1; k_lost[i] = 1; err = E_LEASE_LOST;
                    printf("EV w%d confirm_lease: heartbeat refused, LeaseLost\n", i)
                fi }
            if
            :: err == E_CANCELLED ->                            /* take the send back */
                record_not_charged;
                if :: err == E_FENCED || err == E_LEASE_LOST -> skip :: else -> err = E_CANCELLED fi;
                goto failed
            :: err != E_NONE -> goto failed
            :: else -> skip
            fi;

STEP_bounded_send:  /* BoundedHttp: the bound checked right before each write to the socket */
            atomic {
                ((!fl_used[0] || !fl_used[1]) || b_left[i] == 0) ->
#ifndef NO_SEND_BOUND
                if
                :: b_left[i] == 0 -> err = E_DEADLINE;
                    printf("EV w%d SendDeadlinePassed: its bound passed, nothing sent\n", i)
                :: else ->
#endif
                    printf("EV w%d sends the charge (bound in %d ticks, fence %d)\n", i,
                           b_left[i], w_fence[i]);
                    /* P4: no send after the holder's bound: it still holds a lease no one
                     * could have taken over */
                    assert(l_status == INP && l_fence == w_fence[i] && l_left > SKEW);
                    assert(r_status != R_CANCELLED);   /* P5: a cancelled request sends nothing */
                    assert(!(mode == REPLAY && replay_of_completed)); /* P6: nor a replay of a
                                                                         completed one */
                    if
                    :: !fl_used[0] -> k = 0
                    :: else -> k = 1
                    fi;
                    fl_used[k] = 1; fl_left[k] = P; fl_own[k] = i + 1; w_ans[i] = A_NONE; k = 0
#ifndef NO_SEND_BOUND
                fi
#endif
                ;
                b_left[i] = 0 }
            if
            :: err == E_DEADLINE ->
                tries++;
                if
                :: tries < SEND_TRIES -> err = E_NONE; goto send_try
                :: else ->
                    record_not_charged;
                    if :: err == E_FENCED || err == E_LEASE_LOST -> skip :: else -> err = E_TRANSIENT fi;
                    goto failed
                fi
            :: else -> skip
            fi;

STEP_answer:        /* the gateway's answer: charged, not charged (503), or none */
            if
            :: atomic { w_ans[i] == A_CHARGED -> w_ans[i] = A_NONE; charged = 1;
                printf("EV w%d the gateway answers: charged\n", i) }
            :: atomic { w_ans[i] == A_NOTCH -> w_ans[i] = A_NONE;
                printf("EV w%d the gateway answers: not charged\n", i) };
                record_not_charged;
                if :: err == E_FENCED || err == E_LEASE_LOST -> skip :: else -> err = E_TRANSIENT fi;
                goto failed
            :: atomic { lost < MAX_LOST && w_ans[i] == A_NONE -> lost++;
                if :: fl_own[0] == i + 1 -> fl_own[0] = 0 :: else -> skip fi;
                if :: fl_own[1] == i + 1 -> fl_own[1] = 0 :: else -> skip fi;
                err = E_TRANSIENT;                              /* PaymentNotSettled */
                printf("EV w%d no answer (HttpNoAnswer): PaymentNotSettled\n", i) };
                goto failed
            fi;
            maybe_beat;

record_charge:
STEP_record_charge: /* ctx.check_lease(), locked_row, fenced_update + checkpoint(CHARGED) */
            atomic {
                if
                :: check_lease_fails -> err = E_LEASE_LOST; say_lease_lost
                :: !check_lease_fails && !fence_ok -> err = E_FENCED
                :: !check_lease_fails && fence_ok && cancel_asked -> err = E_CANCELLED
                :: !check_lease_fails && fence_ok && !cancel_asked && !owner_ok ->
                    err = E_LEASE_LOST
                :: !check_lease_fails && fence_ok && !cancel_asked && owner_ok ->
                    fenced_write_asserts;
                    o_status = O_CNC; o_charge = 1; o_fence = w_fence[i];
                    l_rp = 1; l_left = L
                fi;
                printf("EV w%d record_charge: %e\n", i, err) }
            if :: err != E_NONE -> goto failed :: else -> skip fi;

STEP_confirm:       /* locked_row (check_lease), fenced_update(paid) + ctx.complete: one txn */
            atomic {
                if
                :: check_lease_fails -> err = E_LEASE_LOST; say_lease_lost
                :: !check_lease_fails && !fence_ok -> err = E_FENCED
                :: !check_lease_fails && fence_ok && !owner_ok -> err = E_LEASE_LOST
                :: !check_lease_fails && fence_ok && owner_ok ->
                    fenced_write_asserts;
                    o_status = O_PAID; o_fence = w_fence[i];
                    l_status = COMPLETED; l_left = 0; err = E_DONE
                fi;
                printf("EV w%d confirm: %e\n", i, err) }
            if :: err != E_DONE -> goto failed :: else -> skip fi;

completed:
STEP_mark_completed:    /* RequestStore.mark_completed (refuses a cancel still requested) */
            atomic {
                if
                :: r_status == R_PENDING || r_status == R_RUNNING || r_status == R_FAILED ->
                    r_status = R_COMPLETED;
                    if :: r_cancel == C_REQUESTED -> r_cancel = C_REFUSED :: else -> skip fi
                :: else -> skip
                fi;
                printf("EV w%d R %e\n", i, r_status) }
            goto run_end;

failed:
            /* ---- engine.runtime._failed, then the failure path (engine/failures.py) ---- */
            cause = err;
            if
            :: err == E_LEASE_LOST && claimed && mode != BATCH ->
STEP_survived:      /* IdempotencyStore.survived: the holder stalled, it did not die */
                atomic {
                    if :: l_fence > w_fence[i] && l_crashes > 0 -> l_crashes-- :: else -> skip fi }
            :: err != E_LEASE_LOST && claimed ->
STEP_fail:          /* IdempotencyStore.fail (owner): permanent -> failed, else retryable */
                atomic {
                    if
                    :: owner_ok ->
                        l_left = 0;
                        if
                        :: (err == E_PERMANENT || err == E_CANCELLED) -> l_status = FAILED
                        :: else -> l_status = RETRYABLE
                        fi
                    :: else -> cause = E_LEASE_LOST;
                        if
                        :: mode != BATCH && l_fence > w_fence[i] && l_crashes > 0 -> l_crashes--
                        :: else -> skip
                        fi
                    fi;
                    printf("EV w%d fail: K %e\n", i, l_status) }
            :: else -> skip
            fi;
            w_fence[i] = 0; claimed = 0;
            if
            :: err == E_CANCELLED ->
STEP_mark_cancelled:    /* FailurePath.settle_request -> RequestStore.mark_cancelled */
                atomic {
                    if
                    :: (r_status == R_RUNNING || r_status == R_PENDING || r_status == R_FAILED) &&
                       (r_cancel == C_REQUESTED || r_cancel == C_CANCELLED) ->
                        r_status = R_CANCELLED; r_cancel = C_CANCELLED
                    :: else -> skip
                    fi;
                    printf("EV w%d R %e\n", i, r_status) }
            :: err != E_CANCELLED && err != E_PERMANENT && mode != BATCH &&
               attempt + 1 < MAXA ->
                attempt++;                                      /* RetryRequested */
                goto mark_running
            :: else ->
STEP_mark_failed:       /* RequestStore.mark_failed, dead-lettered at the decision */
                atomic {
                    if
                    :: r_status == R_PENDING || r_status == R_RUNNING ->
                        r_status = R_FAILED; dlq = D_OPEN
                    :: else -> skip
                    fi;
#ifndef OLD_CANCEL_AT_ONCE
                    /* RequestStore.settle_requested_cancel, same transaction: a cancel that
                     * waited for the key's holder ends once no live holder holds it */
                    if
                    :: (r_status == R_PENDING || r_status == R_FAILED) &&
                       r_cancel == C_REQUESTED && !key_held ->
                        r_status = R_CANCELLED; r_cancel = C_CANCELLED;
                        if :: dlq == D_OPEN -> dlq = D_CLOSED :: else -> skip fi
                    :: else -> skip
                    fi;
#endif
                    printf("EV w%d gives up (%e): R %e, DLQ %e\n", i, err, r_status, dlq) }
            fi;
run_end:
            skip
        } unless {
            atomic { kill[i] ->     /* STEP_killed: SIGKILL, the run dies */
                if :: fl_own[0] == i + 1 -> fl_own[0] = 0 :: else -> skip fi;
                if :: fl_own[1] == i + 1 -> fl_own[1] = 0 :: else -> skip fi;
                w_ans[i] = A_NONE;
                printf("EV w%d is killed (fence %d)\n", i, w_fence[i]);
                if
                :: redelivered < MAX_REDELIVER ->               /* a run retry redelivers R */
                    redelivered++; deliveries!mode, rrun;
                    printf("EV R delivered again after the death of w%d\n", i)
                :: true ->                                      /* settle_unsettled */
                    if
                    :: (r_status == R_PENDING || (r_status == R_RUNNING && r_by == rrun)) ->
                        r_status = R_FAILED; dlq = D_OPEN
                    :: else -> skip
                    fi;
                    printf("EV run failure sensor: R %e, DLQ %e\n", r_status, dlq)
                fi }
        };
        atomic {
            if
            :: mode == REPLAY && dlq == D_REPLAY ->             /* the replay's run ended */
                if
                :: r_status == R_COMPLETED -> dlq = D_RESOLVED
                :: r_status == R_CANCELLED -> dlq = D_CLOSED
                :: else -> dlq = D_OPEN
                fi
            :: else -> skip
            fi;
            kill[i] = 0; busy[i] = 0; w_fence[i] = 0; k_left[i] = 0;
            k_lost[i] = 0; b_left[i] = 0; s_left[i] = 0; w_sent[i] = 0; w_settle[i] = 0; w_ans[i] = A_NONE;
            mode = SOLO; err = E_NONE; cause = E_NONE; attempt = 0; claimed = 0;
            takeover = 0; rp = 0; sent = 0; charged = 0; tries = 0; k = 0; rrun = 0 }
    od
}

init {
    byte i;
    atomic {
        i = 0;
        do
        :: i < NW -> k_left[i] = 0; b_left[i] = 0; s_left[i] = 0; w_sent[i] = 0; w_settle[i] = 0; w_ans[i] = A_NONE;
                     run Worker(i); i++
        :: else -> break
        od;
        deliveries!SOLO, 1;
        started = 1
    }
}
