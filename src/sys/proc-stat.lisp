;;;; The machine's processor time, from the first line of /proc/stat
;;;; (proc(5)): the ticks idle and the ticks in all, read through one
;;;; descriptor kept open and read again from its start each time (one
;;;; pread(2), where opening, reading and closing the file took five system
;;;; calls).

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +processor-ticks-octets+ 512
  "Room for the first line of /proc/stat: \"cpu\" and ten counts of ticks.")

(defun parse-processor-ticks (buffer end)
  "The ticks idle (idle and iowait) and the ticks in all (steal included,
guest time being counted in user time already) of the first line of
/proc/stat, in BUFFER below END; NIL when it is not such a line."
  (let* ((line-end (or (position 10 buffer :end end) end))
         (line (map 'string #'code-char (subseq buffer 0 line-end))))
    (when (and (> (length line) 4) (string= "cpu " line :end2 4))
      (let ((ticks (loop with position = 4
                         repeat 8
                         collect (multiple-value-bind (number number-end)
                                     (parse-integer line :start position :junk-allowed t)
                                   (setf position number-end)
                                   number))))
        (when (every #'integerp ticks)
          (values (+ (nth 3 ticks) (nth 4 ticks))
                  (reduce #'+ ticks)))))))

(defstruct (processor-ticks (:constructor make-processor-ticks ()))
  "Where the machine's processor time is read: one thread's."
  ;; A descriptor open on /proc/stat, or NIL while it is not (not opened
  ;; yet, or it could not be).
  (fd nil)
  (buffer (make-array +processor-ticks-octets+ :element-type '(unsigned-byte 8)) :read-only t))

(defun read-processor-ticks (ticks)
  "The machine's processor time now, as PARSE-PROCESSOR-TICKS gives it, read
through TICKS' descriptor on /proc/stat (opened first if need be), or NIL
when it cannot be read."
  (let* ((fd (or (processor-ticks-fd ticks)
                 (setf (processor-ticks-fd ticks) (values (open-regular-file "/proc/stat")))))
         (buffer (processor-ticks-buffer ticks))
         (count (and fd (read-file-octets fd buffer 0))))
    (and count (parse-processor-ticks buffer count))))

(defun close-processor-ticks (ticks)
  "Close TICKS' descriptor on /proc/stat, if open."
  (let ((fd (shiftf (processor-ticks-fd ticks) nil)))
    (when fd
      (close-fd fd))))
