package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/outboxinspect"
)

func statsCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "stats",
		Short: "Counts by state, the oldest due message's age, the last failure",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			d, done, err := g.dispatcher(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			s, err := d.Stats(cmd.Context())
			if err != nil {
				return err
			}
			return g.printStats(s, time.Now())
		},
	}
}

// listFlags are the filter flags of list and of requeue's dry run.
type listFlags struct {
	states, types                []string
	aggType, aggID               string
	olderThan, newerThan         time.Duration
	limit                        int
	oldestFirst, inSequenceOrder bool
}

func listCmd(g *globals) *cobra.Command {
	var l listFlags
	cmd := &cobra.Command{
		Use:   "list",
		Short: "Messages filtered by state, event type, aggregate and age, newest first",
		Example: `  outboxctl list --db sqlite:./app.db --state failed
  outboxctl list --db postgres://localhost/app --type order.created --older-than 1h --oldest
  outboxctl list --db sqlite:./app.db --aggregate-type order --aggregate-id 42 --sequence-order -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if l.oldestFirst && l.inSequenceOrder {
				return errors.New("list: --oldest and --sequence-order exclude each other")
			}
			for _, s := range l.states {
				switch s {
				case outbox.StatePending, outbox.StateDelivering, outbox.StateDelivered, outbox.StateRetry, outbox.StateFailed:
				default:
					return fmt.Errorf("list: --state %q is none of pending, delivering, delivered, retry, failed", s)
				}
			}
			if l.limit < 1 || l.limit > outboxinspect.MaxMessageLimit {
				return fmt.Errorf("list: --limit %d is not between 1 and %d", l.limit, outboxinspect.MaxMessageLimit)
			}
			f := outboxinspect.MessageFilter{States: l.states, EventTypes: l.types, AggregateType: l.aggType, AggregateID: l.aggID, Limit: l.limit}
			now := time.Now()
			if l.olderThan > 0 {
				f.CreatedBefore = now.Add(-l.olderThan)
			}
			if l.newerThan > 0 {
				f.CreatedAfter = now.Add(-l.newerThan)
			}
			switch {
			case l.oldestFirst:
				f.Order = outboxinspect.OldestFirst
			case l.inSequenceOrder:
				f.Order = outboxinspect.SequenceOrder
			}
			d, done, err := g.dispatcher(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			msgs, err := outboxinspect.New(d).Messages(cmd.Context(), f)
			if err != nil {
				return err
			}
			return g.printMessages(msgs, now)
		},
	}
	fl := cmd.Flags()
	fl.StringSliceVar(&l.states, "state", nil, "keep messages in these states (pending, delivering, delivered, retry, failed); repeat or separate by commas")
	fl.StringSliceVar(&l.types, "type", nil, "keep messages of these event types")
	fl.StringVar(&l.aggType, "aggregate-type", "", "keep messages of this aggregate type")
	fl.StringVar(&l.aggID, "aggregate-id", "", "keep messages of this aggregate id")
	fl.DurationVar(&l.olderThan, "older-than", 0, "keep messages written longer ago than this, as in 30m or 24h")
	fl.DurationVar(&l.newerThan, "newer-than", 0, "keep messages written within this much time")
	fl.IntVar(&l.limit, "limit", outboxinspect.DefaultMessageLimit, "print at most this many messages")
	fl.BoolVar(&l.oldestFirst, "oldest", false, "oldest first instead of newest first")
	fl.BoolVar(&l.inSequenceOrder, "sequence-order", false, "by aggregate and sequence, the order of delivery")
	return cmd
}

func showCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:     "show EVENT_ID",
		Short:   "One message whole: payload, headers, attempts, last error, lease",
		Example: `  outboxctl show --db sqlite:./app.db 0b6f1c0e-6a1f-4c1e-9d0a-3f1b2c3d4e5f`,
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			d, done, err := g.dispatcher(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			m, err := outboxinspect.New(d).Message(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			return g.printMessage(m, time.Now())
		},
	}
}

func requeueCmd(g *globals) *cobra.Command {
	var (
		ids, types   []string
		failedBefore string
		limit        int
		all, dryRun  bool
	)
	cmd := &cobra.Command{
		Use:   "requeue",
		Short: "Dead-lettered (failed) messages back to pending, by id, by type, or failed before a time",
		Long: `requeue moves failed messages back to pending with their attempts reset;
the messages of their aggregates that waited behind them follow. Name what
to move with --id, --type or --failed-before (or --all), and look first
with --dry-run, which prints the messages that would move.`,
		Example: `  outboxctl requeue --db sqlite:./app.db --id 0b6f1c0e-6a1f-4c1e-9d0a-3f1b2c3d4e5f
  outboxctl requeue --db postgres://localhost/app --type order.created --failed-before 2h --dry-run
  outboxctl requeue --db postgres://localhost/app --failed-before 2024-05-01T12:00:00Z`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			f := outbox.RequeueFilter{EventIDs: ids, EventTypes: types, Limit: limit}
			if failedBefore != "" {
				t, err := parseBefore(failedBefore, time.Now())
				if err != nil {
					return fmt.Errorf("requeue: --failed-before: %w", err)
				}
				f.FailedBefore = t
			}
			if !all && len(ids) == 0 && len(types) == 0 && f.FailedBefore.IsZero() {
				return errors.New("requeue: name what to move with --id, --type or --failed-before, or pass --all")
			}
			if limit < 0 {
				return fmt.Errorf("requeue: --limit %d is negative", limit)
			}
			d, done, err := g.dispatcher(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			if dryRun {
				msgs, err := outboxinspect.New(d).RequeueCandidates(cmd.Context(), f)
				if err != nil {
					return err
				}
				return g.printMessages(msgs, time.Now())
			}
			n, err := d.Requeue(cmd.Context(), f)
			if err != nil {
				return err
			}
			return g.printCount("requeued", n)
		},
	}
	fl := cmd.Flags()
	fl.StringSliceVar(&ids, "id", nil, "requeue these event ids; repeat or separate by commas")
	fl.StringSliceVar(&types, "type", nil, "requeue the failed messages of these event types")
	fl.StringVar(&failedBefore, "failed-before", "", "requeue messages that failed before this time (RFC 3339) or this long ago (as in 2h)")
	fl.IntVar(&limit, "limit", 0, "move at most this many, oldest failure first (default: the dispatcher's sweep limit, 1000)")
	fl.BoolVar(&all, "all", false, "requeue every failed message (up to --limit)")
	fl.BoolVar(&dryRun, "dry-run", false, "print what would move, and move nothing")
	return cmd
}

// parseBefore reads a time as RFC 3339, or as a duration before now.
func parseBefore(s string, now time.Time) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	if d, err := time.ParseDuration(s); err == nil && d > 0 {
		return now.Add(-d), nil
	}
	return time.Time{}, fmt.Errorf("%q is neither an RFC 3339 time nor a positive duration", s)
}

func purgeCmd(g *globals) *cobra.Command {
	var (
		olderThan time.Duration
		batch     int
	)
	cmd := &cobra.Command{
		Use:   "purge",
		Short: "Delete delivered messages older than an age, in bounded batches",
		Long: `purge deletes delivered messages whose delivery is older than --older-than,
in statements of at most --batch rows, until none is left. It never touches
a message that is not delivered, nor the sequence table. A deleted
message's idempotency key can be written again.`,
		Example: `  outboxctl purge --db postgres://localhost/app --older-than 168h --batch 5000`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if olderThan <= 0 {
				return errors.New("purge: --older-than must be a positive duration, as in 168h")
			}
			if batch < 1 {
				return fmt.Errorf("purge: --batch %d is less than 1", batch)
			}
			d, done, err := g.dispatcher(cmd.Context(), outbox.WithRetention(olderThan), outbox.WithSweepLimit(batch))
			if err != nil {
				return err
			}
			defer done()
			n, err := d.Cleanup(cmd.Context())
			if err != nil {
				return err
			}
			return g.printCount("purged", n)
		},
	}
	cmd.Flags().DurationVar(&olderThan, "older-than", 0, "delete delivered messages delivered longer ago than this (required)")
	cmd.Flags().IntVar(&batch, "batch", outbox.DefaultSweepLimit, "delete at most this many rows per statement")
	return cmd
}

func migrateCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:     "migrate",
		Short:   "Apply the outbox schema's migrations (creates the tables when missing)",
		Example: `  outboxctl migrate --db sqlite:./app.db`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			db, err := g.open(cmd.Context(), true)
			if err != nil {
				return err
			}
			defer func() {
				if sqlDB, err := db.DB(); err == nil {
					sqlDB.Close()
				}
			}()
			if err := outbox.AutoMigrate(db.WithContext(cmd.Context())); err != nil {
				return err
			}
			fmt.Fprintf(g.stdout, "migrated %s\n", g.table)
			return nil
		},
	}
}

func checkCmd(g *globals) *cobra.Command {
	var (
		o      outboxinspect.CheckOptions
		noLag  bool
		maxDue time.Duration
	)
	cmd := &cobra.Command{
		Use:   "check",
		Short: "Verify the outbox's promises on the live table; exit 2 on a violation",
		Long: `check verifies, on the live table:
  - sequences gapless per aggregate (below the lowest remaining row,
    cleanup may have deleted delivered ones);
  - no delivered message after one of its aggregate that no claim has taken
    since it was written or requeued (a late settle explains the others);
  - no delivering message whose lease ended more than --lease-grace ago;
  - every idempotency key and event id once;
  - the oldest due message younger than --max-due-age.
It prints each violation on a line and exits with status 2 when there is one.

Run it after your own chaos tests (killed dispatchers, restarted databases),
once the dispatchers have drained what they could.`,
		Example: `  outboxctl check --db postgres://localhost/app
  outboxctl check --db sqlite:./app.db --lease-grace 2m --max-due-age 10m -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if o.LeaseGrace <= 0 {
				return fmt.Errorf("check: --lease-grace %v is not positive", o.LeaseGrace)
			}
			if maxDue <= 0 {
				return fmt.Errorf("check: --max-due-age %v is not positive", maxDue)
			}
			o.MaxDueAge = maxDue
			if noLag {
				o.MaxDueAge = -1
			}
			d, done, err := g.dispatcher(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			vs, err := outboxinspect.New(d).Check(cmd.Context(), o)
			if err != nil {
				return err
			}
			if err := g.printViolations(vs); err != nil {
				return err
			}
			if len(vs) > 0 {
				return fmt.Errorf("%w: %d", errViolations, len(vs))
			}
			return nil
		},
	}
	fl := cmd.Flags()
	fl.DurationVar(&o.LeaseGrace, "lease-grace", outboxinspect.DefaultCheckLeaseGrace, "how long after its lease ended a delivering message may wait")
	fl.DurationVar(&maxDue, "max-due-age", outboxinspect.DefaultCheckMaxDueAge, "how long the oldest due message may have waited")
	fl.BoolVar(&noLag, "no-lag", false, "skip the due-age check (for a table no dispatcher drains)")
	return cmd
}

// printCount reports how many messages a command moved.
func (g *globals) printCount(verb string, n int) error {
	if g.output == "json" {
		return json.NewEncoder(g.stdout).Encode(map[string]int{verb: n})
	}
	_, err := fmt.Fprintf(g.stdout, "%s %d message(s)\n", verb, n)
	return err
}
