package main

import (
	"context"
	"fmt"

	"gorm.io/gorm"
)

// The backlog scenario: the same drain as dispatch (one outbox dispatcher,
// batch 1,000) from a small and from a big backlog, to show whether the
// claim stays fast as the table grows: an ideal claim costs the same per
// event whatever the number of pending rows.

const backlogBatch = 1000

func runBacklog(ctx context.Context, e *env, c config, r *report) error {
	var rows [][]string
	var names []string
	for _, n := range []int{c.smallBacklog, c.bigBacklog} {
		res, err := pgOutboxDrain(ctx, e, "backlog", n, c.aggregates, func(ctx context.Context, s *schema) (drainResult, error) {
			return drainOutbox(ctx, func() (*gorm.DB, error) { return s.gormDB(2) }, 1, backlogBatch, n)
		})
		if err != nil {
			return fmt.Errorf("backlog of %d: %w", n, err)
		}
		name := "backlog_outbox_" + sizeName(n)
		names = append(names, name)
		r.add(name, res.rate(), "events/s")
		note := ""
		if res.timedOut {
			note = "timed out, partial"
		}
		rows = append(rows, []string{fmt.Sprintf("%d", n), res.elapsed.Round(1e6).String(), f1(res.rate()), note})
	}
	r.ratio("backlog_ratio_big_over_small", names[1], names[0])
	if v, ok := r.get("backlog_ratio_big_over_small"); ok {
		rows = append(rows, []string{"big / small", "", f2(v), ""})
	}
	r.table(fmt.Sprintf("backlog scaling: 1 outbox dispatcher, batch %d, %d aggregates", backlogBatch, c.aggregates),
		[]string{"pending events", "time", "events/s", ""}, rows)
	return nil
}
