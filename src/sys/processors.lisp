;;;; The processors this process may use: those of its affinity mask
;;;; (sched_getaffinity(2): taskset, numactl, a container's cpuset), and no
;;;; more than its cgroup's processor quota allows, rounded up (cgroup v2's
;;;; cpu.max, v1's cpu.cfs_quota_us over cpu.cfs_period_us: Docker's --cpus,
;;;; Kubernetes' limits), the narrowest quota of its cgroup and the
;;;; cgroup's ancestors.  Read once, when a taskmaster is made: a process
;;;; moved to other processors afterwards keeps the sizes it started with.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +affinity-mask-octets+ 128
  "The affinity mask asked of the kernel: room for 1,024 processors.")

(defun affinity-processors ()
  "The numbers of the processors the calling thread may run on, in
increasing order, or NIL when the kernel does not say."
  (let ((mask (make-array +affinity-mask-octets+ :element-type '(unsigned-byte 8) :initial-element 0)))
    (when (zerop (sb-sys:with-pinned-objects (mask)
                   (sb-alien:alien-funcall
                    (sb-alien:extern-alien "sched_getaffinity"
                                           (function sb-alien:int sb-alien:int sb-alien:unsigned-long
                                                     sb-sys:system-area-pointer))
                    0 +affinity-mask-octets+ (sb-sys:vector-sap mask))))
      (loop for processor below (* 8 +affinity-mask-octets+)
            when (logbitp (mod processor 8) (aref mask (floor processor 8)))
              collect processor))))

(defun parse-cgroup-v2-quota (text)
  "The processors cgroup v2's cpu.max TEXT (\"QUOTA PERIOD\", QUOTA \"max\"
for none) allows, a rational, or NIL for no quota."
  (let ((fields (cl-ppcre:split "\\s+" (string-trim '(#\Space #\Tab #\Newline) text))))
    (cgroup-quota (first fields) (second fields))))

(defun cgroup-quota (quota period)
  "QUOTA microseconds of processor time a PERIOD, both texts, as the
processors they allow, a rational; NIL when QUOTA is \"max\" or negative
(no quota) or either is not a count."
  (let ((quota (and quota (parse-integer quota :junk-allowed t)))
        (period (and period (parse-integer period :junk-allowed t))))
    (and quota period (plusp quota) (plusp period) (/ quota period))))

(defun parse-proc-self-cgroup (text)
  "The cgroups of /proc/self/cgroup's TEXT: a list of (CONTROLLERS . PATH),
CONTROLLERS a list of strings, empty for cgroup v2's line."
  (loop for line in (cl-ppcre:split "\\n" text)
        for (nil controllers path) = (cl-ppcre:split ":" line :limit 3)
        when path
          collect (cons (cl-ppcre:split "," controllers) path)))

(defun read-small-file (namestring)
  "The text of the file NAMESTRING, or NIL when it cannot be read."
  (ignore-errors (uiop:read-file-string namestring :external-format :latin-1)))

(defun cgroup-directories (mount path)
  "The directories of the cgroup PATH under MOUNT and of its ancestors up to
MOUNT, the cgroup's own first, those that exist: inside a container the
cgroup's path may name the host's hierarchy while MOUNT shows its own."
  (loop for prefix = (string-trim "/" path) then (subseq prefix 0 (or (position #\/ prefix :from-end t) 0))
        for directory = (if (zerop (length prefix)) mount (format nil "~A~A/" mount prefix))
        when (directory-path-p directory)
          collect directory
        while (plusp (length prefix))))

(defun cpuacct-usage-file (mount relative-directory own-path)
  "cgroup v1's usage file under MOUNT for the quota set in RELATIVE-DIRECTORY
of the cpu controller's hierarchy: the same directory when the cpuacct
hierarchy has it (the two controllers mounted together, as Docker and
systemd mount them), else the process's own cgroup OWN-PATH there."
  (let ((same (concatenate 'string mount relative-directory)))
    (concatenate 'string (if (directory-path-p same)
                             same
                             (first (cgroup-directories mount own-path)))
                 "cpuacct.usage")))

(defun cgroup-limits (cgroups)
  "Each processor quota CGROUPS (as PARSE-PROC-SELF-CGROUP returns them) set
on this process's cgroups, as a list of (PROCESSORS USAGE-FILE
USAGE-UNITS-A-SECOND): v2's cpu.max with its cpu.stat's usage_usec, v1's
quota with cpuacct.usage in nanoseconds."
  (flet ((v1-cgroup (controller)
           (find-if (lambda (cgroup) (member controller (car cgroup) :test #'string=)) cgroups)))
    (let ((v2-path (cdr (assoc nil cgroups)))
          (v1-cpu (v1-cgroup "cpu"))
          (v1-cpuacct (v1-cgroup "cpuacct")))
      (append
       (when (and v2-path (probe-file "/sys/fs/cgroup/cgroup.controllers"))
         (loop for directory in (cgroup-directories "/sys/fs/cgroup/" v2-path)
               for quota = (let ((text (read-small-file (concatenate 'string directory "cpu.max"))))
                             (and text (parse-cgroup-v2-quota text)))
               when quota
                 collect (list quota (concatenate 'string directory "cpu.stat") 1000000)))
       (when (and v1-cpu v1-cpuacct)
         (let ((cpu-mount (format nil "/sys/fs/cgroup/~{~A~^,~}/" (car v1-cpu)))
               (cpuacct-mount (format nil "/sys/fs/cgroup/~{~A~^,~}/" (car v1-cpuacct))))
           (loop for directory in (cgroup-directories cpu-mount (cdr v1-cpu))
                 for quota = (cgroup-quota (read-small-file (concatenate 'string directory "cpu.cfs_quota_us"))
                                           (read-small-file (concatenate 'string directory "cpu.cfs_period_us")))
                 when quota
                   collect (list quota (cpuacct-usage-file cpuacct-mount (subseq directory (length cpu-mount))
                                                           (cdr v1-cpuacct))
                                 1000000000))))))))

(defstruct (processor-limit (:constructor %make-processor-limit))
  "Which processors this process may use, and how many."
  ;; How many processors' time the process may use at once, at least 1: the
  ;; processors of its affinity mask, or its cgroup's quota rounded up when
  ;; that is fewer.
  (count 1 :type (integer 1) :read-only t)
  ;; The numbers of the processors of the affinity mask when they are fewer
  ;; than the machine's online processors, else NIL: all of them.
  (processors nil :type list :read-only t)
  ;; When the cgroup's quota is the narrower limit: the processors it
  ;; allows (a rational), the file its cgroup's processor time is read from
  ;; and that time's units a second; else NIL.
  (quota nil :read-only t)
  (usage-file nil :read-only t)
  (usage-units-a-second nil :read-only t))

(defun processor-limit ()
  "The processors this process may use now, a PROCESSOR-LIMIT."
  (let* ((online (online-processor-count))
         (affinity (affinity-processors))
         (mask-count (if affinity (min (length affinity) online) online))
         (narrowest (first (sort (cgroup-limits (let ((text (read-small-file "/proc/self/cgroup")))
                                                  (and text (parse-proc-self-cgroup text))))
                                 #'< :key #'first))))
    (if (and narrowest (< (first narrowest) mask-count))
        (destructuring-bind (quota usage-file units) narrowest
          (%make-processor-limit :count (max 1 (ceiling quota)) :quota quota
                                 :usage-file usage-file :usage-units-a-second units))
        (%make-processor-limit :count (max 1 mask-count)
                               :processors (and affinity (< (length affinity) online) affinity)))))
