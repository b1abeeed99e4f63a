package outbox

import (
	"context"
	"testing"
	"time"

	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// A run is read through the whole key of the aggregate index, so that a
// claim's runs cost their span, not the aggregate's backlog: the range
// join it replaced read every undelivered index entry of the aggregate
// (counted as Handler_icp_attempts: the range filtered them in InnoDB).
func TestMySQLRunsReadTheirSpanNotTheAggregatesBacklog(t *testing.T) {
	t.Parallel()
	db, _ := outboxtest.OpenMySQL(t, nil)
	noErr(t, AutoMigrate(db))
	// One deep aggregate among a hundred shallow ones: the index's
	// statistics say an aggregate has some 20 undelivered rows.
	const backlog, span = 1000, 5
	noErr(t, db.Exec(`INSERT INTO outbox_records (event_id, event_type, aggregate_type, aggregate_id,
	aggregate_sequence, idempotency_key, payload, next_attempt_at, occurred_at, created_at, updated_at)
SELECT CONCAT('e', n.i, '-', m.j), 't', 'agg', CASE WHEN m.j <= 10 THEN 'deep' ELSE CONCAT('a', n.i) END,
	CASE WHEN m.j <= 10 THEN (n.i - 1) * 10 + m.j ELSE m.j - 10 END, CONCAT('e', n.i, '-', m.j), '{}', ?, ?, ?, ?
FROM (WITH RECURSIVE n (i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 100) SELECT i FROM n) n
CROSS JOIN (WITH RECURSIVE m (j) AS (SELECT 1 UNION ALL SELECT j + 1 FROM m WHERE j < 20) SELECT j FROM m) m`,
		time.Now().UTC().Add(-time.Hour), time.Now().UTC(), time.Now().UTC(), time.Now().UTC()).Error)
	// The statistics a table in use has (InnoDB takes them again after
	// a tenth of it changed); a fresh one has none yet.
	noErr(t, db.Exec(`ANALYZE TABLE outbox_records`).Error)
	d := mysqlDialect{}
	st := d.statements(d.tables("outbox_records"))
	reads := func(q querier) int64 {
		res, err := q.QueryContext(context.Background(), `SHOW SESSION STATUS WHERE Variable_name IN ('Handler_read_key', 'Handler_read_next', 'Handler_icp_attempts')`)
		noErr(t, err)
		defer res.Close()
		var n int64
		for res.Next() {
			var name string
			var v int64
			noErr(t, res.Scan(&name, &v))
			n += v
		}
		noErr(t, res.Err())
		return n
	}
	noErr(t, d.claimTx(context.Background(), db, func(q querier) error {
		before := reads(q)
		res, err := q.QueryContext(context.Background(), st.runs,
			append([]any{d.timeArg(time.Now()), span}, d.eventList([]aggregateSeq{{aggregateKey{"agg", "deep"}, 10}})...)...)
		if err != nil {
			return err
		}
		var seqs []int64
		for res.Next() {
			var (
				i         int
				id, seq   int64
				claimable bool
			)
			if err := res.Scan(&i, &id, &seq, &claimable); err != nil {
				return err
			}
			seqs = append(seqs, seq)
		}
		if err := res.Close(); err != nil {
			return err
		}
		read := reads(q) - before
		if len(seqs) != span {
			t.Errorf("run of %d from #10: sequences %v, want 10 to 14", span, seqs)
		}
		if read > 4*span {
			t.Errorf("a run of %d in an aggregate of %d read %d index entries, want at most %d", span, backlog, read, 4*span)
		}
		return nil
	}))
}
