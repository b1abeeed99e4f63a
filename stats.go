package outbox

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// Stats counts the outbox rows by delivery state, for health checks,
// dashboards and tests.
type Stats struct {
	Pending, Delivering, Delivered, Retry, Failed int64
	// OldestDue is the next_attempt_at of the longest-waiting row that is
	// due (pending, retry or delivering past its lease); zero when none is.
	// time.Since(OldestDue) is the dispatch lag.
	OldestDue time.Time
	// LastFailure is the last_error of the most recently dead-lettered row,
	// empty when none is failed.
	LastFailure string
}

// Undelivered is how many rows are not delivered yet, failed ones included.
func (s Stats) Undelivered() int64 { return s.Pending + s.Delivering + s.Retry + s.Failed }

// Stats reads the counts of the outbox table. The counts read every row,
// delivered history included, so call it for monitoring at human rates
// (outboxprom caches it between scrapes), not on a hot path.
func (d *Dispatcher) Stats(ctx context.Context) (Stats, error) {
	var s Stats
	rows, err := d.pool().QueryContext(ctx, d.st.Counts)
	if err != nil {
		return s, fmt.Errorf("outbox: stats: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var (
			state string
			n     int64
		)
		if err := rows.Scan(&state, &n); err != nil {
			return s, fmt.Errorf("outbox: stats: %w", err)
		}
		switch state {
		case StatePending:
			s.Pending = n
		case StateDelivering:
			s.Delivering = n
		case StateDelivered:
			s.Delivered = n
		case StateRetry:
			s.Retry = n
		case StateFailed:
			s.Failed = n
		}
	}
	if err := rows.Err(); err != nil {
		return s, fmt.Errorf("outbox: stats: %w", err)
	}
	var oldest dialect.Time
	if err := d.pool().QueryRowContext(ctx, d.st.OldestDue, d.d.TimeArg(time.Now())).Scan(&oldest); err != nil {
		return s, fmt.Errorf("outbox: stats: %w", err)
	}
	s.OldestDue = oldest.Time
	if s.Failed > 0 {
		var last sql.NullString
		if err := d.pool().QueryRowContext(ctx, d.st.LastFailure).Scan(&last); err != nil {
			return s, fmt.Errorf("outbox: stats: %w", err)
		}
		s.LastFailure = last.String
	}
	return s, nil
}
