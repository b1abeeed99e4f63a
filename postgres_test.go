package outbox_test

import (
	"strings"
	"testing"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

func TestPostgresClaimReadsOnlyDueRows(t *testing.T) {
	b := setup(t, outboxtest.Postgres, nil)
	var def string
	mustNil(t, b.db.Raw(`SELECT indexdef FROM pg_indexes WHERE indexname = 'outbox_records_due'`).Scan(&def).Error)
	if !strings.Contains(def, "(next_attempt_at, id)") || !strings.Contains(def, "WHERE") {
		t.Fatalf("due index %q, want partial on (next_attempt_at, id)", def)
	}
	mustNil(t, b.db.Exec(`INSERT INTO outbox_records (event_id, event_type, aggregate_type, aggregate_id, aggregate_sequence,
		idempotency_key, payload, delivery_state, next_attempt_at, occurred_at, created_at, updated_at)
		SELECT 'e'||g, 't', 'a', g::text, 1, 'k'||g, '{}', CASE WHEN g % 100 = 0 THEN 'pending' ELSE 'delivered' END,
			now(), now(), now(), now() FROM generate_series(1, 20000) g`).Error)
	mustNil(t, b.db.Exec(`ANALYZE outbox_records`).Error)
	plan := explain(t, b.db, `SELECT id FROM outbox_records WHERE delivery_state IN ('pending', 'retry', 'delivering')
		AND next_attempt_at <= now() ORDER BY next_attempt_at, id LIMIT 100 FOR UPDATE SKIP LOCKED`)
	// Whatever the plan, it reads due rows through the partial indexes and
	// never the delivered history.
	if !strings.Contains(plan, "outbox_records_due") || strings.Contains(plan, "Seq Scan") {
		t.Fatalf("the claim scan reads more than the due rows:\n%s", plan)
	}
}

func explain(t *testing.T, db *gorm.DB, query string) string {
	t.Helper()
	rows, err := db.Raw("EXPLAIN " + query).Rows()
	mustNil(t, err)
	defer rows.Close()
	var lines []string
	for rows.Next() {
		var line string
		mustNil(t, rows.Scan(&line))
		lines = append(lines, line)
	}
	return strings.Join(lines, "\n")
}
