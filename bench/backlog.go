package main

import (
	"context"
	"database/sql"
	"fmt"

	"gorm.io/gorm"
)

// The backlog scenario: the same drain as dispatch (one outbox dispatcher,
// batch 1,000) from a small and from a big backlog, to show whether the
// claim stays fast as the table grows: an ideal claim costs the same per
// event whatever the number of pending rows. The raw-SQL loop drains the
// same two backlogs, because the server itself slows down once the table
// outgrows its cache: its ratio is the floor the outbox's is judged by.

const backlogBatch = 1000

func runBacklog(ctx context.Context, e *env, c config, r *report) error {
	var rows [][]string
	for _, system := range []string{"outbox", "raw"} {
		var names []string
		for _, n := range []int{c.smallBacklog, c.bigBacklog} {
			res, err := pgOutboxDrain(ctx, e, "backlog_"+system, n, c.aggregates, func(ctx context.Context, s *schema) (drainResult, error) {
				if system == "raw" {
					return drainRaw(ctx, func() (*sql.DB, error) { return s.sqlDB(2) }, rawPostgres, 1, backlogBatch, n)
				}
				return drainOutbox(ctx, func() (*gorm.DB, error) { return s.gormDB(2) }, 1, backlogBatch, n)
			})
			if err != nil {
				return fmt.Errorf("%s backlog of %d: %w", system, n, err)
			}
			name := fmt.Sprintf("backlog_%s_%s", system, sizeName(n))
			names = append(names, name)
			r.add(name, res.rate(), "events/s")
			note := ""
			if res.timedOut {
				note = "timed out, partial"
			}
			rows = append(rows, []string{system, fmt.Sprintf("%d", n), res.elapsed.Round(1e6).String(), f1(res.rate()), note})
		}
		ratio := "backlog_ratio_big_over_small"
		if system == "raw" {
			ratio = "backlog_ratio_raw_big_over_small"
		}
		r.ratio(ratio, names[1], names[0])
		if v, ok := r.get(ratio); ok {
			rows = append(rows, []string{system, "big / small", "", f2(v), ""})
		}
	}
	r.table(fmt.Sprintf("backlog scaling: 1 dispatcher (raw loop: 1 worker), batch %d, %d aggregates", backlogBatch, c.aggregates),
		[]string{"system", "pending events", "time", "events/s", ""}, rows)
	return nil
}
