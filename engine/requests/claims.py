"""How requests leave the queue: the intake sensor's claim (to ``launched``, a run per request
is launched next) and a resident worker's claim (straight to ``running`` under its run), both
in claim order, shared fairly between tenants, a debounce group at a time.

Each claim is one transaction. Two claimers never take the same request: on Postgres the
claiming statement locks the rows it picks and skips the rows another claimer holds
(``FOR UPDATE SKIP LOCKED`` in a materialised CTE); on SQLite it is one statement under the
write lock (``BEGIN IMMEDIATE``). The texts are the dialects' blocks of ``claim``,
``fair_claim``, ``due_groups`` and ``debounce_group`` in the query files.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import groupby
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.engine import Connection

from engine.requests.model import JobRequest, Merge, RequestStatus
from engine.requests.views import RequestViews
from engine.tenants import TenantStore, allocate, charged_passes, effective_shares, setting_from_row
from resources.idempotency import payload_hash
from resources.storage.json_text import canonical


class ClaimedPage(list[JobRequest]):
    """The requests one claim took, first claimed first, and ``drained``: whether the claim
    left nothing claimable behind it as of its own reads (every tenant's claimable requests
    counted in full and all taken, no debounce group due), so a worker may wait for the next
    wake-up instead of claiming again at once (every request committed after those reads
    pushes its wake-up after its commit). False whenever that is not certain: a full page, a
    page cut by the scheduler (a tenant held at its maximum share), rows another claimer
    held, debounce groups."""

    drained: bool = False

    @classmethod
    def of(cls, rows: Sequence[JobRequest], *, drained: bool) -> ClaimedPage:
        page = cls(rows)
        page.drained = drained
        return page


class RequestClaims(RequestViews):
    """The claims of the intake sensor and of the resident workers."""

    def claim_for_launch(
        self,
        limit: int,
        *,
        relaunch_after: float = 120.0,
        job_types: Iterable[str] | None = None,
        merge: Merge | None = None,
    ) -> list[JobRequest]:
        """Move up to ``limit`` requests to ``launched`` and return them, first claimed first.

        Claims ``pending`` ones and ``launched`` ones untouched for ``relaunch_after`` seconds,
        lowest ``claim_rank`` first (``created_at - priority * aging``, fixed at enqueue; ties by
        id). That is the highest effective priority ``priority + waited / aging`` at any moment,
        read from an index instead of sorting the backlog. A request of priority ``p`` is
        overtaken only by requests created less than ``(PRIORITY_MAX - p) * aging`` seconds after
        it: a finite set, so nothing starves however much urgent work keeps arriving.

        Debounced requests (``debounce_key`` set) are claimed a group at a time, once the group
        is due: its newest request is ``debounce_wait`` old (the burst is over) or its oldest is
        ``debounce_max_wait`` old (a steady stream still runs that often). The newest request of
        the group is launched (``merge(job_type, payloads oldest first)`` may replace its payload)
        with ``coalesced_count`` set; every other one becomes ``coalesced`` with ``coalesced_into``
        naming it, in the same transaction, so two claimers never launch one group twice.
        While ``coalesced`` may not be written (:meth:`writable`: a process of the previous
        release may still read requests), debounced requests are claimed one by one like the
        others, as the previous release claims them.
        """
        return self._claim(limit, relaunch_after=relaunch_after, job_types=job_types,
                           merge=merge, to=self._q["to_launched"], owner=None)

    def claim_for_worker(
        self,
        limit: int,
        *,
        owner: str,
        job_types: Iterable[str],
        relaunch_after: float = 120.0,
        merge: Merge | None = None,
    ) -> ClaimedPage:
        """A resident worker's claim: as :meth:`claim_for_launch` (claim order, fair share,
        debounce groups, requests due again), but the requests go straight to ``running`` under
        ``owner`` (the worker's run id), each counting an attempt, in the same statement: no
        run is launched for them, the worker runs them next. Only requests available now
        (``available_at``) are claimed. Every later move of the request by this worker names
        ``owner``, so a worker that lost the request (its run was declared dead and the request
        given to another) moves nothing. The page says whether it ``drained`` the queue
        (:class:`ClaimedPage`)."""
        return self._claim(limit, relaunch_after=relaunch_after, job_types=job_types,
                           merge=merge, to=self._q["to_running"], owner=owner)

    def set_run_keys(self, run_keys: dict[int, str]) -> None:
        """Record the run key each launched request was emitted under (for lookups in the UI)."""
        if not run_keys:
            return
        with self.db.transaction() as conn:
            conn.execute(
                text(self._q["set_run_key"]),
                [{"id": i, "rk": rk} for i, rk in run_keys.items()],
            )

    def _claim(
        self,
        limit: int,
        *,
        relaunch_after: float,
        job_types: Iterable[str] | None,
        merge: Merge | None,
        to: str,
        owner: str | None,
    ) -> ClaimedPage:
        if limit <= 0:
            return ClaimedPage()
        now = self.clock()
        types = sorted(job_types) if job_types is not None else None
        if types is not None and not types:
            return ClaimedPage.of([], drained=True)
        params: dict[str, Any] = {"now": now, "cutoff": now - relaunch_after, "limit": limit,
                                  "owner": owner, "set": to}
        coalesce = self.writable(RequestStatus.COALESCED)
        with self.db.transaction() as conn:
            virtual = TenantStore.lock_clock(conn, now) if self.fair else 0.0
            claimed, due = (self._claim_debounced(conn, params, types, merge) if coalesce
                            else ([], 0))
            rest = {**params, "limit": max(0, limit - len(claimed))}
            if self.fair:
                plain, drained = self._claim_fair(conn, rest, types, claimed, virtual,
                                                  debounced=not coalesce)
            elif rest["limit"]:
                plain = self._claim_plain(conn, rest, types, debounced=not coalesce)
                drained = len(plain) < rest["limit"]
            else:
                plain, drained = [], False
        drained = drained and not due and rest["limit"] > 0
        if len({r.tenant for r in [*claimed, *plain]}) > 1:
            return ClaimedPage.of(sorted(claimed, key=lambda r: (r.claim_rank, r.id)) + plain,
                                  drained=drained)
        return ClaimedPage.of(sorted(claimed + plain, key=lambda r: (r.claim_rank, r.id)),
                              drained=drained)

    def _typed(self, name: str, types: list[str] | None, **fill: str) -> Any:
        """The statement ``name`` with its ``{placeholders}`` filled (``fill``, from the query
        file's fragments), limited to ``types`` when given."""
        fill.setdefault("types", self._q["of_types"] if types is not None else "")
        statement = text(self._q[name].format(**fill))
        if types is not None:
            statement = statement.bindparams(bindparam("types", expanding=True))
        return statement

    def _plain(self, debounced: bool) -> str:
        """``{plain}``: every pending request, or (debounced ones claimed by group) the others."""
        return "" if debounced else self._q["not_debounced"]

    def _claim_plain(
        self, conn: Connection, params: dict[str, Any], types: list[str] | None,
        *, debounced: bool = False,
    ) -> list[JobRequest]:
        sql = self._typed("claim", types, plain=self._plain(debounced), set=params["set"])
        rows = conn.execute(sql, {**params, "types": types}).all()
        return [JobRequest.from_row(r) for r in rows]

    def _claim_fair(
        self, conn: Connection, params: dict[str, Any], types: list[str] | None,
        earlier: Sequence[JobRequest], virtual: float, *, debounced: bool,
    ) -> tuple[list[JobRequest], bool]:
        """The plain requests of a page, split between tenants by :mod:`engine.tenants`: one
        statement finds the tenants with work (a skip scan of ``job_requests_tenant_claim``)
        with their settings, passes and claimable counts (ranges of
        ``job_requests_tenant_waiting``, stopping at the page), the scheduler gives each a
        quota, and one statement claims each tenant's first ``quota`` requests in claim order.
        Returned in the scheduler's slot order; the page (``earlier``, the
        debounced groups claimed before, included) is charged to the tenants' passes.

        The count is two ranges of ``job_requests_tenant_waiting`` (pending; launched and due
        again), so it never reads the table nor walks the tenant's requests already claimed (a
        pending request given back for a retry later is counted before its ``available_at``:
        the page then comes back that much short, rather than the count reading the table); the
        ``ORDER BY`` of the index keeps Postgres off a sequential scan that statistics of a
        large backlog would otherwise make look cheap under the ``LIMIT``. The launched range is
        read from its cutoff down, so the requests in flight (after the cutoff) are never
        stepped over, however many dead index entries of earlier claims sit among them.

        Also whether the page drained what it found: each tenant's count was below the page
        (not cut at it), the plan gave each all of its count, and every row planned was taken
        (none held by another claimer)."""
        limit = int(params["limit"])
        plain = self._plain(debounced)
        found: Sequence[Any] = []
        if limit:
            found = conn.execute(self._typed("active_tenants", types, plain=plain),
                                 {**params, "types": types}).all()
        settings = {r.name: setting_from_row(r) for r in found if r.weight is not None}
        passes = {r.name: float(r.pass_) for r in found if r.pass_ is not None}
        available = {r.name: min(limit, int(r.pending) + int(r.due))
                     for r in found if r.pending or r.due}
        plan = allocate(available, effective_shares(available, settings), passes, virtual, limit)
        picked: list[JobRequest] = []
        if plan.quotas:
            bind: dict[str, Any] = {**params, "types": types}
            branches = []
            of_types = self._q["of_types"] if types is not None else ""
            for i, (tenant, quota) in enumerate(sorted(plan.quotas.items())):
                branches.append(self._q["fair_branch"].format(i=i, plain=plain, types=of_types))
                bind[f"t{i}"], bind[f"n{i}"] = tenant, quota
            sql = self._typed("fair_claim", types, branches=" UNION ALL ".join(branches),
                              set=params["set"])
            rows = conn.execute(sql, bind).all()
            picked = [JobRequest.from_row(r) for r in rows]
        queues: dict[str, Iterator[JobRequest]] = {}
        for tenant, group in groupby(sorted(picked, key=lambda r: (r.tenant, r.claim_rank, r.id)),
                                     key=lambda r: r.tenant):
            queues[tenant] = iter(list(group))
        ordered = [r for r in (next(queues[t], None) for t in plan.slots if t in queues)
                   if r is not None]
        counts: dict[str, int] = {}
        for request in [*earlier, *ordered]:
            counts[request.tenant] = counts.get(request.tenant, 0) + 1
        TenantStore.charge(conn, charged_passes(plan, counts, passes), counts, plan.clock,
                           float(params["now"]))
        drained = (len(picked) == sum(plan.quotas.values())
                   and all(n < limit and plan.quotas.get(t, 0) == n
                           for t, n in available.items()))
        return ordered, drained

    def _claim_debounced(
        self,
        conn: Connection,
        params: dict[str, Any],
        types: list[str] | None,
        merge: Merge | None,
    ) -> tuple[list[JobRequest], int]:
        """The due debounce groups' winners claimed, and how many groups were due."""
        due = conn.execute(self._typed("due_groups", types), {**params, "types": types}).all()
        out: list[JobRequest] = []
        for group in sorted(str(g.debounce_key) for g in due):
            # every claimer takes the groups in the same order (Postgres locks their rows)
            rows = conn.execute(text(self._q["debounce_group"]),
                                {"k": group, "now": params["now"]}).all()
            members = [JobRequest.from_row(r) for r in rows]
            if not members:
                continue
            winner, rest = members[-1], members[:-1]
            payload = winner.payload
            if merge is not None and rest:
                payload = merge(winner.job_type, [m.payload for m in members])
            row = conn.execute(
                self._typed("claim_debounce_winner", None, set=params["set"]),
                {"now": params["now"], "owner": params["owner"], "payload": canonical(payload),
                 "hash": payload_hash(payload), "n": len(rest), "id": winner.id},
            ).first()
            if row is None:
                continue
            if rest:
                conn.execute(
                    text(self._q["coalesce_group"]).bindparams(bindparam("ids", expanding=True)),
                    {"into": winner.id, "now": params["now"], "ids": [m.id for m in rest]},
                )
            out.append(JobRequest.from_row(row))
        return out, len(due)
