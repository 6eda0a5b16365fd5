/*
 * The Redis lock's fence and the fence registry (resources/locks/redis_lock.py _ACQUIRE,
 * _RELEASE; resources/locks/fencing.py fenced_write, _ADVANCE), with a Redis that loses its
 * recent writes: a restart without persistence or from an older snapshot, a failover to a
 * lagging replica. Three holders take the lock (ROUNDS times each), write the resource through
 * fenced_write, and release; any of them may pause anywhere, past the lock's TTL.
 *
 * Property (P7): no business write by a holder whose fence is stale: once a holder granted
 * later has written the resource, no holder granted earlier writes it.
 *
 * Broken variant: REDIS_NO_FLOOR, the fence is the counter alone (INCR), not
 * max(counter + 1, the server's clock): a counter that lost grants hands out a token below
 * one already granted.
 */

#ifndef ROUNDS
#define ROUNDS 1        /* grants each holder asks for */
#endif
#ifndef TTL
#define TTL 1           /* the lock's PX, in ticks */
#endif
#ifndef TMAX
#define TMAX 6          /* the server clock's horizon (each grant reads it) */
#endif
#ifndef MAX_LOSS
#define MAX_LOSS 1      /* times Redis comes back without its recent writes */
#endif

/* Redis: the fence counter, the lock key (owner token = grant number), its TTL; a snapshot */
byte counter = 0;
byte lk_owner = 0;
byte lk_left = 0;
byte snap_counter = 0, snap_owner = 0, snap_left = 0;
byte rtime = 1;         /* the server clock (TIME), in ticks; never goes back */
byte losses = 0;

/* fence_registry: the highest fence the resource saw and its holder */
byte highest = 0;
byte reg_holder = 0;

/* ghosts: grants in order, and the latest grant that wrote the resource */
byte grants = 0;
byte last_writer = 0;

active proctype Clock() {
end_clock:
    do
    :: atomic { rtime < TMAX -> rtime++;
        if :: lk_left > 0 -> lk_left--;
              if :: lk_left == 0 -> lk_owner = 0 :: else -> skip fi
           :: else -> skip fi;
        printf("TICK\n") }
    od
}

/* Redis persistence: SAVE at any time; a restart or failover brings back the last snapshot,
 * and takes at least a tick (the server clock moves on). */
active proctype Redis() {
end_redis:
    do
    :: atomic {         /* STEP_save */
        snap_counter = counter; snap_owner = lk_owner; snap_left = lk_left;
        printf("EV redis SAVE: snapshot with counter %d\n", counter) }
    :: atomic { losses < MAX_LOSS && rtime < TMAX ->   /* STEP_lose_writes */
        losses++; counter = snap_counter; lk_owner = snap_owner; lk_left = snap_left;
        rtime++;
        printf("EV redis restarts from its snapshot: counter back to %d, lock owner %d\n",
               counter, lk_owner) }
    od
}

proctype Holder(byte h) {
    byte round = 0;
    byte fence = 0;
    byte me = 0;        /* this grant's owner token (its number among all grants) */
end_holder:
    do
    :: round < ROUNDS ->
STEP_acquire:   /* RedisLock._try_acquire: the _ACQUIRE script */
        atomic { lk_owner == 0 ->
#ifdef REDIS_NO_FLOOR
            fence = counter + 1;
#else
            fence = counter + 1;                 /* max(INCR, the server clock) */
            if :: fence < rtime -> fence = rtime :: else -> skip fi;
#endif
            counter = fence;
            grants++; me = grants;
            lk_owner = me; lk_left = TTL;
            printf("EV h%d acquires the lock: grant %d, fence %d (counter %d, clock %d)\n", h,
                   me, fence, counter, rtime) }
STEP_fenced_write:  /* fenced_write: _ADVANCE, then the business write, one transaction */
        atomic {
            if
            :: fence > highest || (fence == highest && reg_holder == me) ->
                printf("EV h%d writes the resource with fence %d (grant %d)\n", h, fence, me);
                assert(me >= last_writer);      /* P7: no write by a stale holder */
                highest = fence; reg_holder = me; last_writer = me
            :: else ->
                printf("EV h%d fenced write rejected: fence %d, highest %d\n", h, fence,
                       highest)
            fi }
STEP_release:   /* RedisLock._release_remote: the _RELEASE script (compare-and-delete) */
        atomic {
            if :: lk_owner == me -> lk_owner = 0; lk_left = 0 :: else -> skip fi;
            round++; fence = 0; me = 0 }
    :: round >= ROUNDS -> break
    od
}

init {
    atomic { run Holder(0); run Holder(1); run Holder(2) }
}
