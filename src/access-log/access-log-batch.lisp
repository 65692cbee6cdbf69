;;;; The entries of one access log destination -- a file's name or a stream
;;;; -- kept in one buffer and written together: at most
;;;; +ACCESS-LOG-FLUSH-MILLISECONDS+ after the first of them was kept (a
;;;; timer of the worker's readiness set, or the engine's maintenance when
;;;; the timer was lost with its set), as soon as the buffer holds
;;;; +ACCESS-LOG-FLUSH-OCTETS+, and at STOP.  A file is opened by its name
;;;; for each write, as Hunchentoot opens it for each line: a file renamed
;;;; away (logrotate, mv) is followed by a new one at the next write, and
;;;; each entry is in one of the two, once.  A write that fails (a missing
;;;; directory, a full disk, a closed stream) loses its entries, counted;
;;;; the request was answered before.
;;;;
;;;; Locking.  LOCK guards the buffer's octets and counts; it is held for a
;;;; copy of an entry's octets, the only lock the request path takes, and
;;;; never while writing.  WRITE-LOCK is held by the one write under way,
;;;; from the taking of the buffer to the end of its write, so that entries
;;;; are written in the order they were kept: a connection's next request
;;;; is read after its reply, whose entry was kept before it was sent.
;;;; WRITE-LOCK is taken before LOCK, never the other way.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +access-log-flush-octets+ 65536
  "Entries kept this many octets are written at once.")

(defconstant +access-log-flush-milliseconds+ 100
  "Entries are written at most this long after the first of them was kept.")

(defstruct (access-log (:constructor %make-access-log (destination path)))
  "The entries of one destination waiting to be written, and its counts."
  ;; An ACCEPTOR-ACCESS-LOG-DESTINATION: a stream, or the name of a file.
  (destination nil :read-only t)
  ;; The file's native namestring, or NIL for a stream.
  (path nil :read-only t)
  (lock (bt:make-lock "access log entries") :read-only t)
  (write-lock (bt:make-lock "access log write") :read-only t)
  ;; Entries kept, the octets below END; twice the flush size, so that the
  ;; entry that fills it finds room.  SPARE takes its place while it is
  ;; written.
  (octets (make-array (* 2 +access-log-flush-octets+) :element-type '(unsigned-byte 8)) :type octets)
  (spare (make-array (* 2 +access-log-flush-octets+) :element-type '(unsigned-byte 8)) :type octets)
  (end 0 :type fixnum)
  ;; Entries kept and not written yet, and the internal real time the first
  ;; of them was kept (for the maintenance's catch-up).
  (kept-entries 0 :type fixnum)
  (first-kept-time 0 :type fixnum)
  ;; Entries written since the process began, and entries lost to writes
  ;; that failed.
  (written-entries 0 :type word)
  (lost-entries 0 :type word)
  ;; While writes fail, the system's words for the first failure; else NIL.
  (failure nil))

(defvar *access-logs* '()
  "Every ACCESS-LOG made, one per destination: a stream or a file's name.")

(defvar *access-logs-lock* (bt:make-lock "access logs"))

(defun destination-file-path (destination)
  "The native namestring of DESTINATION, a pathname designator, merged with
*DEFAULT-PATHNAME-DEFAULTS* as WITH-OPEN-FILE merges it; NIL for a stream."
  (and (typep destination '(or string pathname))
       (native-path (merge-pathnames destination))))

(defun find-access-log (destination)
  "The ACCESS-LOG of DESTINATION, made at its first entry: one for each
stream, one for each file however its name is spelled."
  (let ((path (destination-file-path destination)))
    (bt:with-lock-held (*access-logs-lock*)
      (or (find-if (lambda (log)
                     (if path
                         (equal path (access-log-path log))
                         (eq destination (access-log-destination log))))
                   *access-logs*)
          (let ((log (%make-access-log destination path)))
            (push log *access-logs*)
            log)))))

(defun keep-access-log-entry (log octets end)
  "Keep the entry of OCTETS below END in LOG's buffer, if it has room: :FIRST
when it is the only entry kept (the caller sees that it is written within
+ACCESS-LOG-FLUSH-MILLISECONDS+), :FULL when the buffer now holds enough to
be written, T when kept among others; NIL when there was no room."
  (declare (type access-log log) (type octets octets) (type fixnum end))
  (bt:with-lock-held ((access-log-lock log))
    (let ((start (access-log-end log))
          (buffer (access-log-octets log)))
      (when (<= (+ start end) (length buffer))
        (replace buffer octets :start1 start :end2 end)
        (setf (access-log-end log) (+ start end))
        (cond ((zerop (access-log-kept-entries log))
               (setf (access-log-kept-entries log) 1
                     (access-log-first-kept-time log) (get-internal-real-time))
               (if (>= end +access-log-flush-octets+) :full :first))
              (t
               (incf (access-log-kept-entries log))
               (if (>= (+ start end) +access-log-flush-octets+) :full t)))))))

(defun take-kept-entries (log)
  "Take LOG's buffer, leaving the spare in its place: its octets, their
end and the count of entries in them.  With WRITE-LOCK held."
  (bt:with-lock-held ((access-log-lock log))
    (let ((octets (access-log-octets log)))
      (setf (access-log-octets log) (access-log-spare log)
            (access-log-spare log) octets)
      (values octets
              (shiftf (access-log-end log) 0)
              (shiftf (access-log-kept-entries log) 0)))))

(defun write-log-octets (log octets end)
  "Write the OCTETS below END to LOG's destination: NIL when written, else
the words for what failed."
  (if (access-log-path log)
      (append-octets-to-file (access-log-path log) octets end)
      (handler-case
          (let ((stream (access-log-destination log)))
            (write-string (utf-8-octets-string octets 0 end) stream)
            (finish-output stream)
            nil)
        (error (condition)
          (princ-to-string condition)))))

(defun note-log-write (log entries failure)
  "Count the ENTRIES of a write written, or lost when FAILURE says what
failed.  With WRITE-LOCK held.  Returns :FAILING and FAILURE for the first
write that failed after one that did not, :WRITTEN-AGAIN and the count of
entries lost for the first written after failures, else NIL."
  (cond (failure
         (incf (access-log-lost-entries log) entries)
         (unless (access-log-failure log)
           (setf (access-log-failure log) failure)
           (values :failing failure)))
        (t
         (incf (access-log-written-entries log) entries)
         (when (access-log-failure log)
           (setf (access-log-failure log) nil)
           (values :written-again (access-log-lost-entries log))))))

(defun flush-access-log (log &optional entry-octets (entry-end 0))
  "Write the entries LOG keeps, then, if given, the entry of ENTRY-OCTETS
below ENTRY-END, one too large for the buffer.  Returns as NOTE-LOG-WRITE:
the entry's report, else the buffer's."
  (bt:with-lock-held ((access-log-write-lock log))
    (multiple-value-bind (octets end entries) (take-kept-entries log)
      (multiple-value-bind (report detail)
          (if (plusp end)
              (note-log-write log entries (write-log-octets log octets end))
              (values nil nil))
        (multiple-value-bind (entry-report entry-detail)
            (and entry-octets (note-log-write log 1 (write-log-octets log entry-octets entry-end)))
          ;; Both writes failing report the first failure, once.
          (if entry-report (values entry-report entry-detail) (values report detail)))))))

(defun every-access-log ()
  (bt:with-lock-held (*access-logs-lock*) (copy-list *access-logs*)))

(defun overdue-access-logs ()
  "The access logs keeping an entry for twice +ACCESS-LOG-FLUSH-MILLISECONDS+
or longer: their timer was lost with the readiness set that had it."
  (let ((limit (- (get-internal-real-time)
                  (* 2 (/ (* +access-log-flush-milliseconds+ internal-time-units-per-second) 1000)))))
    (remove-if-not (lambda (log)
                     (and (plusp (access-log-kept-entries log))
                          (< (access-log-first-kept-time log) limit)))
                   (every-access-log))))

(defun write-kept-entries-at-exit ()
  "Write what every access log keeps: a process may exit without STOP."
  (dolist (log (every-access-log))
    (ignore-errors (flush-access-log log))))

(call-at-exit 'write-kept-entries-at-exit)
