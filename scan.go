package outbox

import (
	"fmt"
	"time"
)

// scanTime scans a timestamp whichever way the driver returns it: a
// time.Time, or the text SQLite stores.
type scanTime struct{ Time time.Time }

func (s *scanTime) Scan(v any) error {
	switch v := v.(type) {
	case time.Time:
		s.Time = v
		return nil
	case string:
		return s.parse(v)
	case []byte:
		return s.parse(string(v))
	case nil:
		s.Time = time.Time{}
		return nil
	}
	return fmt.Errorf("outbox: cannot scan %T into a timestamp", v)
}

func (s *scanTime) parse(v string) error {
	for _, layout := range []string{sqliteTime, time.RFC3339Nano, "2006-01-02 15:04:05.999999999-07:00", "2006-01-02 15:04:05"} {
		if t, err := time.Parse(layout, v); err == nil {
			s.Time = t
			return nil
		}
	}
	return fmt.Errorf("outbox: unrecognised timestamp %q", v)
}

// scanBools reads a one-column boolean result that must have exactly n
// rows, and closes it.
func scanBools(res resultRows, n int) ([]bool, error) {
	defer res.Close()
	out := make([]bool, 0, n)
	for res.Next() {
		var b bool
		if err := res.Scan(&b); err != nil {
			return nil, err
		}
		out = append(out, b)
	}
	if err := res.Err(); err != nil {
		return nil, err
	}
	if len(out) != n {
		return nil, fmt.Errorf("outbox: %d answers to %d lookups", len(out), n)
	}
	return out, nil
}
