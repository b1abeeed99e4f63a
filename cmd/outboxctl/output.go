package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/outboxinspect"
)

// age formats how long ago t was, "-" for the zero time.
func age(t, now time.Time) string {
	if t.IsZero() {
		return "-"
	}
	d := now.Sub(t)
	switch {
	case d < 0:
		return "in " + (-d).Round(time.Second).String()
	case d < time.Minute:
		return d.Round(time.Millisecond).String()
	}
	return d.Round(time.Second).String()
}

func stamp(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339Nano)
}

// clip shortens s to one line of at most n runes, for a table cell.
func clip(s string, n int) string {
	s = oneLine(s)
	if r := []rune(s); len(r) > n {
		return string(r[:n-1]) + "…"
	}
	if s == "" {
		return "-"
	}
	return s
}

func (g *globals) json(v any) error {
	enc := json.NewEncoder(g.stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// statsJSON is stats -o json: every name in snake_case, as in the
// messages' JSON.
type statsJSON struct {
	Pending             int64      `json:"pending"`
	Delivering          int64      `json:"delivering"`
	Delivered           int64      `json:"delivered"`
	Retry               int64      `json:"retry"`
	Failed              int64      `json:"failed"`
	OldestDue           *time.Time `json:"oldest_due,omitempty"`
	OldestDueAgeSeconds *float64   `json:"oldest_due_age_seconds,omitempty"`
	LastFailure         string     `json:"last_failure,omitempty"`
}

func (g *globals) printStats(s outbox.Stats, now time.Time) error {
	if g.output == "json" {
		var dueAge *float64
		if !s.OldestDue.IsZero() {
			a := now.Sub(s.OldestDue).Seconds()
			dueAge = &a
		}
		return g.json(statsJSON{s.Pending, s.Delivering, s.Delivered, s.Retry, s.Failed, timePtr(s.OldestDue), dueAge, s.LastFailure})
	}
	w := tabwriter.NewWriter(g.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "STATE\tCOUNT")
	for _, r := range []struct {
		state string
		n     int64
	}{{outbox.StatePending, s.Pending}, {outbox.StateDelivering, s.Delivering}, {outbox.StateRetry, s.Retry},
		{outbox.StateFailed, s.Failed}, {outbox.StateDelivered, s.Delivered}} {
		fmt.Fprintf(w, "%s\t%d\n", r.state, r.n)
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "oldest due\t%s\n", age(s.OldestDue, now))
	fmt.Fprintf(w, "last failure\t%s\n", clip(s.LastFailure, 200))
	return w.Flush()
}

func timePtr(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}

func (g *globals) printMessages(msgs []outboxinspect.MessageInfo, now time.Time) error {
	if g.output == "json" {
		if msgs == nil {
			msgs = []outboxinspect.MessageInfo{}
		}
		return g.json(msgs)
	}
	w := tabwriter.NewWriter(g.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "EVENT_ID\tTYPE\tAGGREGATE\tSEQ\tSTATE\tATTEMPTS\tWRITTEN\tNEXT_ATTEMPT\tLAST_ERROR")
	for _, m := range msgs {
		fmt.Fprintf(w, "%s\t%s\t%s/%s\t%d\t%s\t%d\t%s ago\t%s\t%s\n", m.EventID, clip(m.EventType, 40),
			clip(m.AggregateType, 30), clip(m.AggregateID, 40), m.Sequence, m.State, m.Attempts,
			age(m.CreatedAt, now), nextAttempt(m, now), clip(m.LastError, 60))
	}
	if err := w.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(g.stdout, "%d message(s)\n", len(msgs))
	return err
}

func nextAttempt(m outboxinspect.MessageInfo, now time.Time) string {
	switch m.State {
	case outbox.StateDelivered, outbox.StateFailed:
		return "-"
	}
	if !m.NextAttemptAt.After(now) {
		return "due"
	}
	return age(m.NextAttemptAt, now)
}

func (g *globals) printMessage(m outboxinspect.MessageInfo, now time.Time) error {
	if g.output == "json" {
		return g.json(m)
	}
	w := tabwriter.NewWriter(g.stdout, 0, 4, 2, ' ', 0)
	row := func(k, v string) { fmt.Fprintf(w, "%s\t%s\n", k, v) }
	row("event id", m.EventID)
	row("event type", m.EventType)
	row("aggregate", m.AggregateType+"/"+m.AggregateID)
	row("sequence", fmt.Sprint(m.Sequence))
	row("idempotency key", m.IdempotencyKey)
	row("state", m.State)
	row("attempts", fmt.Sprint(m.Attempts))
	row("next attempt", stamp(m.NextAttemptAt)+" ("+nextAttempt(m, now)+")")
	lease := "-"
	if !m.LockedUntil.IsZero() {
		lease = "until " + stamp(m.LockedUntil) + " (batch " + m.BatchID + ")"
		if !m.LockedUntil.After(now) {
			lease += ", ended " + age(m.LockedUntil, now) + " ago"
		}
	}
	row("lease", lease)
	row("last error", clip(m.LastError, 2000))
	row("occurred", stamp(m.OccurredAt))
	row("written", stamp(m.CreatedAt))
	row("updated", stamp(m.UpdatedAt))
	row("delivered", stamp(m.DeliveredAt))
	if err := w.Flush(); err != nil {
		return err
	}
	if len(m.Headers) > 0 {
		fmt.Fprintln(g.stdout, "headers:")
		keys := make([]string, 0, len(m.Headers))
		for k := range m.Headers {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			fmt.Fprintf(g.stdout, "  %s: %s\n", k, m.Headers[k])
		}
	}
	var pretty bytes.Buffer
	if err := json.Indent(&pretty, m.Payload, "", "  "); err != nil {
		pretty.Reset()
		pretty.Write(m.Payload)
	}
	_, err := fmt.Fprintf(g.stdout, "payload:\n%s\n", pretty.String())
	return err
}

func (g *globals) printViolations(vs []outboxinspect.Violation) error {
	if g.output == "json" {
		if vs == nil {
			vs = []outboxinspect.Violation{}
		}
		return g.json(vs)
	}
	if len(vs) == 0 {
		_, err := fmt.Fprintln(g.stdout, "ok: no violation")
		return err
	}
	var b strings.Builder
	for _, v := range vs {
		b.WriteString(oneLine(v.String()))
		b.WriteByte('\n')
	}
	_, err := fmt.Fprint(g.stdout, b.String())
	return err
}
