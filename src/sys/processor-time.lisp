;;;; The processor time of the processors this process may use (its
;;;; PROCESSOR-LIMIT, sys/processors.lisp), idle and in all: the machine's
;;;; from the first line of /proc/stat (proc(5)); some processors' from
;;;; their own lines there; under a cgroup's quota, what the quota allowed
;;;; since the process started less what the cgroup used.  Read through one
;;;; descriptor kept open and read again from its start each time (one
;;;; pread(2), where opening, reading and closing the file took five system
;;;; calls).

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +processor-line-octets+ 256
  "Room for a line of /proc/stat's processor ticks: its name and ten counts.")

(defun line-processor-ticks (line start)
  "The ticks idle (idle and iowait) and the ticks in all (steal included,
guest time being counted in user time already) of the counts in LINE from
START, as two values; NIL when there are not eight counts."
  (let ((ticks (loop with position = start
                     repeat 8
                     collect (multiple-value-bind (number number-end)
                                 (parse-integer line :start position :junk-allowed t)
                               (setf position number-end)
                               number))))
    (when (every #'integerp ticks)
      (values (+ (nth 3 ticks) (nth 4 ticks))
              (reduce #'+ ticks)))))

(defun parse-processor-ticks (buffer end &optional processors)
  "The ticks idle and in all (as LINE-PROCESSOR-TICKS) of /proc/stat's text
in BUFFER below END: of its first line, the machine's, or summed over the
lines of PROCESSORS, a list of processor numbers; NIL when a line is
missing or is not such a line."
  (let ((lines (cl-ppcre:split "\\n" (map 'string #'code-char (subseq buffer 0 end)))))
    (if (null processors)
        (let ((line (first lines)))
          (and line (> (length line) 4) (string= "cpu " line :end2 4)
               (line-processor-ticks line 4)))
        (loop with idle = 0 and total = 0
              for processor in processors
              for name = (format nil "cpu~D " processor)
              for line = (find-if (lambda (line) (eql 0 (search name line))) lines)
              do (multiple-value-bind (line-idle line-total) (and line (line-processor-ticks line (length name)))
                   (unless line-idle
                     (return nil))
                   (incf idle line-idle)
                   (incf total line-total))
              finally (return (values idle total))))))

(defun parse-cgroup-usage (buffer end)
  "The processor time a cgroup has used, from its usage file's text in
BUFFER below END: v2's cpu.stat (its usage_usec line) or v1's
cpuacct.usage (one count); NIL when it is neither."
  (let* ((text (map 'string #'code-char (subseq buffer 0 end)))
         (start (if (eql 0 (search "usage_usec " text)) (length "usage_usec ") 0)))
    (values (parse-integer text :start start :junk-allowed t))))

(defstruct (processor-ticks (:constructor make-processor-ticks
                                (limit &aux (buffer (make-array (* +processor-line-octets+
                                                                   (+ 2 (reduce #'max (processor-limit-processors limit)
                                                                                :initial-value 0)))
                                                                :element-type '(unsigned-byte 8))))))
  "Where the processor time of the processors LIMIT allows is read: one thread's."
  (limit nil :type processor-limit :read-only t)
  ;; A descriptor open on /proc/stat or the cgroup's usage file, or NIL
  ;; while it is not (not opened yet, or it could not be).
  (fd nil)
  (buffer nil :type (simple-array (unsigned-byte 8) (*)) :read-only t))

(defun quota-processor-ticks (limit usage)
  "The time idle and in all, as two values in the cgroup's units, of the
processors LIMIT's quota allows, its cgroup having used USAGE: in all, the
quota's share of the time since the clock's start; idle, that less USAGE."
  (let ((total (* (monotonic-microseconds) (processor-limit-quota limit)
                  (/ (processor-limit-usage-units-a-second limit) 1000000))))
    (values (- total usage) total)))

(defun read-processor-ticks (ticks)
  "The processor time now of the processors TICKS' limit allows, idle and
in all, as two values in units of their own (only their differences
between two readings mean anything), read through TICKS' descriptor
(opened first if need be); NIL when it cannot be read."
  (let* ((limit (processor-ticks-limit ticks))
         (fd (or (processor-ticks-fd ticks)
                 (setf (processor-ticks-fd ticks)
                       (values (open-regular-file (or (processor-limit-usage-file limit) "/proc/stat"))))))
         (buffer (processor-ticks-buffer ticks))
         (count (and fd (read-file-octets fd buffer 0))))
    (cond ((null count) nil)
          ((processor-limit-quota limit)
           (let ((usage (parse-cgroup-usage buffer count)))
             (and usage (quota-processor-ticks limit usage))))
          (t (parse-processor-ticks buffer count (processor-limit-processors limit))))))

(defun close-processor-ticks (ticks)
  "Close TICKS' descriptor, if open."
  (let ((fd (shiftf (processor-ticks-fd ticks) nil)))
    (when fd
      (close-fd fd))))
